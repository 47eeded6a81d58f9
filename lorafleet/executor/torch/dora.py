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

so DoRA is a post-op on the operator's output over each span of a DoRA adapter's rows (:func:`spans`), the one
base GEMM and the segmented low-rank GEMMs unchanged; only the rows of a dropping DoRA adapter pay one more
``(rows, K) x (K, N)`` GEMM for ``D`` (PEFT's DoRA pays a second base GEMM over its whole input in that case). Its
backward is autograd over these rows, exact (n is a constant):

    dm = Σ_rows G ⊙ (Y - b + D) / n                 the magnitude's gradient
    dY = g ⊙ G on the rows (G elsewhere)            into the operator's own backward: dA, dB and X W's dX
    dX += ((g - 1) ⊙ G) W ⊙ (M / (1 - p) - 1)       through D, dropping rows only (from the bool M, kept or
                                                    drawn again, ``_DropoutDelta``: no float factor is
                                                    saved)

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
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from lorafleet.executor.torch.dropout import MaskReplay
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
def spans(segments: Segments, dora: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """``(i, first row, end row)`` of each span of rows rescaled by the ``i``-th adapter of ``dora`` (positions in the
    layer's routing): its segments, merged with the next one of the same adapter across the rows between them that
    belong to no segment (padding: its outputs reach no loss, so rescaling it changes nothing that is read). A padded
    micro-batch of one task is then one span, and each span costs a few whole-slice ops, not a gather per row.
    Cached: every layer of a model asks for the same ones."""
    member = {a: i for i, a in enumerate(dora)}
    out: list[list[int]] = []
    previous = None  # the adapter of the last non-empty segment
    for a, start, length in segments:
        if not length:
            continue
        if a in member:
            if out and previous == a and out[-1][0] == member[a]:
                out[-1][2] = start + length
            else:
                out.append([member[a], start, start + length])
        previous = a
    return tuple((i, first, end) for i, first, end in out)


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
    replay: MaskReplay | None = None,
) -> Tensor:
    """``Y'`` of the module doc on the rows of the DoRA adapters ``dora`` (positions in ``segments``), out of
    place (autograd gives the exact backward above).

    Args:
        y: ``(T, N)`` the plain operator's output; ``x``: ``(T, K)`` its input; ``keep``: its dropout keep-mask
            ``(T, K)`` or None.
        weight, bias: the frozen base layer's (this rank's slices under TP).
        scale: ``g = m / n`` ``(D, N)``, one row per adapter of ``dora`` (differentiable in ``m``).
        dropouts: ``p`` per adapter of ``dora``.
        replay: how ``keep`` was drawn (``dropout.MaskReplay``): the backward draws it again, nothing of it is
            saved; None: ``keep`` is saved (the operator's own mask, ``mask_memory.py``).
    """
    found = spans(segments, dora)
    if not found:
        return y
    extra: tuple[Tensor, ...] = ()  # D of each dropping span, by autograd (its backward reaches X)
    if keep is not None and any(dropouts[i] for i, _, _ in found):
        sizes, done = [], 0
        for _, first, end in found:
            sizes += [first - done, end - first]
            done = end
        # one split (its backward: one cat), not a slice per span (each slice's backward: a zero-filled (T, K))
        x_spans = x.split([*sizes, x.shape[0] - done])[1::2]
        rows = tuple((first, end, dropouts[i]) for i, first, end in found if dropouts[i])
        x_rows = [x_span for (i, _, _), x_span in zip(found, x_spans, strict=True) if dropouts[i]]
        extra = _DropoutDelta.apply(keep, replay, rows, weight, *x_rows)  # D (L, N) of each dropping span
    dropping = tuple(bool(extra) and dropouts[i] > 0 for i, _, _ in found)
    return _Rescale.apply(y, scale, bias, found, dropping, *extra)


def _delta_factor(keep: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    """``Xd - X = X ⊙ φ``: ``φ = 1 / (1 - p) - 1`` where kept, ``-1`` where dropped, ``(L, K)`` in ``dtype``."""
    return torch.where(keep, 1.0 / (1.0 - p) - 1.0, -1.0).to(dtype)


class _DropoutDelta(torch.autograd.Function):
    """``D = (Xd - X) W^T = (X ⊙ φ) W^T`` of each dropping span (:func:`_delta_factor`), and ``dX = (dD W) ⊙ φ``.

    One call for all the dropping spans of a layer call: it saves the layer's bool keep-mask (the operator's own
    tensor: no byte more), or with ``replay`` nothing of it, and the backward draws it again once (``replay.mask()``,
    the whole ``(T, K)``: a generator cannot skip to a span's rows); it remakes each span's ``φ`` from its rows,
    where autograd over ``X * φ`` saved ``φ`` itself: a float ``(L, K)`` a projection, so q, k and v each kept one,
    three times their input. The products are autograd's own, in the same order: the same bits."""

    @staticmethod
    def forward(ctx, keep, replay, rows, weight, *x_rows):
        ctx.replay, ctx.rows = replay, rows
        ctx.save_for_backward(keep if replay is None else None, weight)
        return tuple(
            F.linear(x * _delta_factor(keep[first:end], p, x.dtype), weight)
            for x, (first, end, p) in zip(x_rows, rows, strict=True)
        )

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        keep, weight = ctx.saved_tensors
        if ctx.replay is not None:
            keep = ctx.replay.mask()
        dx = [
            grad.mm(weight) * _delta_factor(keep[first:end], p, grad.dtype)
            for grad, (first, end, p) in zip(grads, ctx.rows, strict=True)
        ]
        return None, None, None, None, *dx


class _Rescale(torch.autograd.Function):
    """``Y' = g ⊙ Y + (1 - g) ⊙ b + (g - 1) ⊙ D`` on each span's rows, ``Y`` elsewhere, written once into a new
    tensor; the backward, one pass each: ``dY = g ⊙ G`` on the spans (``G`` elsewhere), ``dD = (g - 1) ⊙ G`` and
    ``dg = Σ_rows G ⊙ (Y - b + D)``. (The same as autograd over split, addcmul and cat, with two passes over
    ``(T, N)`` fewer: at tiny widths and long segments those passes are most of DoRA's cost.)"""

    @staticmethod
    def forward(ctx, y, scale, bias, found, dropping, *extra):
        out = torch.empty_like(y)
        scale = scale.to(y.dtype)
        done, d = 0, 0
        for k, (i, first, end) in enumerate(found):
            out[done:first] = y[done:first]
            rows, g = out[first:end], scale[i]
            torch.mul(y[first:end], g, out=rows)  # g ⊙ Y
            if bias is not None:
                rows.add_((1 - g) * bias)  # + (1 - g) ⊙ b
            if dropping[k]:
                rows.addcmul_(extra[d], g - 1)  # + (g - 1) ⊙ D
                d += 1
            done = end
        out[done:] = y[done:]
        ctx.found, ctx.dropping, ctx.has_bias = found, dropping, bias is not None
        ctx.save_for_backward(y, scale, bias if bias is not None else y.new_empty(0), *extra)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, scale, bias, *extra = ctx.saved_tensors
        grad_y = torch.empty_like(grad)
        grad_scale = torch.zeros_like(scale)
        grad_extra = []
        done, d = 0, 0
        for k, (i, first, end) in enumerate(ctx.found):
            grad_y[done:first] = grad[done:first]
            g_rows, g = grad[first:end], scale[i]
            torch.mul(g_rows, g, out=grad_y[first:end])  # g ⊙ G
            dg = (g_rows * y[first:end]).sum(dim=0)  # Σ G ⊙ Y (einsum makes it a bmm over transposed copies)
            if ctx.has_bias:
                dg -= bias * g_rows.sum(dim=0)  # - b Σ G
            if ctx.dropping[k]:
                dg += (g_rows * extra[d]).sum(dim=0)  # + Σ G ⊙ D
                grad_extra.append(g_rows * (g - 1))
                d += 1
            grad_scale[i] += dg
            done = end
        grad_y[done:] = grad[done:]
        return grad_y, grad_scale, None, None, None, *grad_extra
