"""DoRA (Liu et al., 2024, arXiv 2402.09353) in the multi-adapter operator: a trained magnitude per output.

An adapter with ``use_dora`` rescales its rows' outputs. With the frozen ``W (N, K)`` and bias ``b``, the
adapter's ``ΔW = s B A`` and its magnitude ``m (N,)`` (PEFT's ``lora_magnitude_vector``):

    n  = ||W + ΔW||_c   (N,)   the L2 norm of each output's row of ``W + ΔW`` (the paper's column norm of
                               ``W^T``), detached: no gradient flows through it (paper §4.3, PEFT's dora.py)
    g  = m / n          (N,)
    Y' = X W^T + b + (g - 1) ⊙ (Xd W^T) + g ⊙ s Xd A^T B^T          PEFT's ``DoraLinearLayer.forward``

Written over the plain operator's output ``Y = X W^T + b + s Xd A^T B^T`` (``multi_lora``), on the rows of the
adapter's segments:

    Y' = Y + (g - 1) ⊙ (Y - b + D),    D = (Xd - X) W^T   (zero without dropout: then Y' = g ⊙ (Y - b) + b)

so DoRA is a per-row post-op on the operator's output, the one base GEMM and the segmented low-rank GEMMs
unchanged; only the rows of a dropping DoRA adapter pay one more ``(rows, K) x (K, N)`` GEMM for ``D`` (PEFT's
DoRA pays a second base GEMM over its whole input in that case). Its backward is autograd over these rows,
exact (n is a constant):

    dm = Σ_rows G ⊙ (Y - b + D) / n                 the magnitude's gradient
    dY = g ⊙ G on the rows (G elsewhere)            into the operator's own backward: dA, dB and X W's dX
    dX += ((g - 1) ⊙ G) W ⊙ (M / (1 - p) - 1)       through D, dropping rows only

**Tensor parallelism** (``tp.py``). A column-parallel layer holds whole rows of ``W`` (and of ``B``): ``n`` is
local, and ``m`` is split like ``B``'s rows. A row-parallel layer holds a slice of every row, ``W[:, K_j]`` and
``A[:, K_j]``, so the norm needs the whole row: ``n² = Σ_j ||W_j + s B A_j||²``, one all-reduce of the squared
norms over the TP group (:func:`weight_norms`); ``m`` is replicated, each rank's partial ``dm`` completed by
the adapter-gradient sum over its holders (``grad_sync``), as ``B``'s is. The rescale is linear in the
partial outputs (the bias is held by TP rank 0 alone), so it runs before the row-parallel all-reduce.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import functional as F

from lorafleet.executor.torch.routing import Segments

MAGNITUDE = "lora_magnitude_vector"
"""The magnitude's factor name: PEFT's module name, so its key in an adapter file is PEFT's
(``...q_proj.lora_magnitude_vector.weight``)."""


def accumulation_dtype(weight: Tensor) -> torch.dtype:
    """The dtype DoRA norms are computed in: fp32 over a 16-bit base, the base's own over fp32 or fp64."""
    return torch.promote_types(weight.dtype, torch.float32)


def row_squares(weight: Tensor) -> Tensor:
    """``||W||²_c`` ``(N,)`` (:func:`accumulation_dtype`): the frozen part of every DoRA norm of a layer (computed
    once, cached by it)."""
    return weight.to(accumulation_dtype(weight)).square().sum(dim=1)


@torch.no_grad()
def weight_norms(
    weight: Tensor,
    lora_A: Sequence[Tensor],
    lora_B: Sequence[Tensor],
    scalings: Sequence[float],
    group: dist.ProcessGroup | None = None,
    weight_sq: Tensor | None = None,
) -> Tensor:
    """``n_a = ||W + s_a B_a A_a||_c`` of each adapter, ``(D, N)`` (:func:`accumulation_dtype`), detached, never
    forming ``W + s B A``:

        n² = ||W||²_c + 2 s rowsum(B ⊙ (W A^T)) + s² rowsum((B (A A^T)) ⊙ B)

    one GEMM ``W [A_1; ...; A_D]^T`` ``(N, Σ r)`` reads ``W`` once for every adapter, and every temporary is
    ``(N, r)``: the direct form writes and reads several ``(N, K)`` ones per adapter (at 7B size, 64 MiB each,
    page-faulted in on a CPU; it made a DoRA step 3x a LoRA one). ``weight_sq`` is :func:`row_squares` of
    ``weight`` when the caller keeps it. With ``group`` (a row-parallel layer: this rank holds the columns
    ``K_j`` of ``W`` and ``A``) every term is a sum over ``K``, so the ranks' squares are summed by one
    all-reduce before the square root.
    """
    acc = accumulation_dtype(weight)
    w2 = row_squares(weight) if weight_sq is None else weight_sq
    ranks = [a.shape[0] for a in lora_A]
    wa = torch.mm(weight, torch.cat(list(lora_A)).to(weight.dtype).T).to(acc).split(ranks, dim=1)  # (N, r) each
    squares = []
    for A, B, s, wa_a in zip(lora_A, lora_B, scalings, wa, strict=True):
        A, B = A.to(acc), B.to(acc)
        cross = (B * wa_a).sum(dim=1)  # (N,) rowsum(B ⊙ W A^T)
        quad = (torch.mm(B, torch.mm(A, A.T)) * B).sum(dim=1)  # (N,) rowsum(B A A^T ⊙ B)
        squares.append(w2 + 2.0 * s * cross + s * s * quad)
    stacked = torch.stack(squares)
    if group is not None:
        dist.all_reduce(stacked, group=group)
    return stacked.clamp_min(0.0).sqrt()


@functools.lru_cache(maxsize=1024)
def _rows(segments: Segments, dora: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """The rows of the segments of the adapters ``dora`` (positions in the layer's routing), and for each
    row the index in ``dora`` of its adapter; cached, as every layer of a model asks for the same ones."""
    member = {a: i for i, a in enumerate(dora)}
    rows: list[int] = []
    which: list[int] = []
    for a, start, length in segments:
        if a in member:
            rows.extend(range(start, start + length))
            which.extend([member[a]] * length)
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(which, dtype=torch.long, device=device)


def rescale(
    y: Tensor,
    x: Tensor,
    keep: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    segments: Segments,
    dora: tuple[int, ...],
    scale: Tensor,
    dropouts: Sequence[float],
) -> Tensor:
    """``Y'`` of the module doc on the rows of the DoRA adapters ``dora`` (positions in ``segments``), out of
    place (autograd gives the exact backward above).

    Args:
        y: ``(T, N)`` the plain operator's output; ``x``: ``(T, K)`` its input; ``keep``: its dropout keep-mask
            ``(T, K)`` or None.
        weight, bias: the frozen base layer's (this rank's slices under TP).
        scale: ``g = m / n`` ``(D, N)``, one row per adapter of ``dora`` (differentiable in ``m``).
        dropouts: ``p`` per adapter of ``dora``.
    """
    rows, which = _rows(segments, dora, y.device)
    if rows.numel() == 0:
        return y
    y_rows = y.index_select(0, rows)  # (R, N)
    residual = y_rows if bias is None else y_rows - bias  # Y - b
    if keep is not None and any(dropouts):
        x_rows = x.index_select(0, rows)  # (R, K)
        inverse = torch.tensor([1.0 / (1.0 - p) for p in dropouts], dtype=x.dtype, device=x.device)
        dropped = x_rows * keep.index_select(0, rows) * inverse.index_select(0, which).unsqueeze(1)  # Xd
        residual = residual + F.linear(dropped - x_rows, weight)  # + D = (Xd - X) W^T
    g = scale.to(y.dtype).index_select(0, which)  # (R, N)
    return y.index_copy(0, rows, y_rows + (g - 1) * residual)
