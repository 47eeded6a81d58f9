"""VeRA (Kopiczko et al., 2024, arXiv 2310.11454) in the multi-adapter operator: a LoRA whose factors are frozen.

A VeRA adapter has one pair of frozen random projections for the whole model, ``A (r, K_max)`` and
``B (N_max, r)`` (``K_max``, ``N_max``: the widest input and output of the linears it targets), and per targeted
layer ``(N, K)`` two trained vectors ``λ_d (r,)`` and ``λ_b (N,)``. As PEFT 0.21's ``vera.Linear.forward``:

    Y = X W^T + b + λ_b ⊙ ((λ_d ⊙ (Xd A_K^T)) B_N^T)       A_K = A[:, :K],  B_N = B[:N, :]

no alpha scaling. That is the operator's LoRA update (``multi_lora``) with scaling 1 and the effective factors

    A' = diag(λ_d) A_K   (r, K),        B' = diag(λ_b) B_N   (N, r)

formed by autograd in each forward (``r K + N r`` multiplies, against the operator's ``T r (K + N)``), so a VeRA
tenant shares the segmented GEMMs, the dropout keep-mask and the micro-batch with LoRA and DoRA tenants. The
operator returns ``dA'``, ``dB'``; autograd's chain rule through the products gives the trained vectors'

    dλ_d = rowsum(dA' ⊙ A_K),       dλ_b = rowsum(dB' ⊙ B_N)

and nothing reaches ``A`` or ``B``.

**The projections** (:func:`draw_projections`) are PEFT's: a CPU ``torch.Generator`` seeded with
``projection_prng_key``, ``A`` then ``B`` from it, each Kaiming-uniform with bound ``sqrt(6 / fan_in)``
(``fan_in`` = ``K_max`` for ``A``, ``r`` for ``B``). ``K_max`` and ``N_max`` are over the *whole* model's targeted
projections (:func:`projection_dims`), so every pipeline stage draws the same pair whatever layers it keeps.
Every layer of a model holding one VeRA adapter refers to one :class:`VeraProjections` (a child module shared by
the layers, so ``.to(device)`` moves it once); its buffers are not persistent: an adapter file stores them once,
as PEFT's ``save_projection=True`` does (``peft_export``), and a checkpoint redraws them from the key.

**Tensor parallelism** (``tp.py``). A layer keeps which rows of ``B_N`` and which columns of ``A_K`` its shard uses
(:class:`ProjectionSlice`): a column-parallel layer all of ``A_K`` and its output rows of ``B_N`` (``λ_b`` split
with them, ``λ_d`` replicated: its gradient is partial on each rank, ``dλ_d = Σ_j rowsum(dA'_j ⊙ A_K)`` with
``dA'_j = (G_j B'_j)^T Xd``); a row-parallel layer its input columns of ``A_K`` and all of ``B_N`` (``λ_d`` and
``λ_b`` replicated, both gradients partial: ``dA'_j`` covers the columns ``K_j`` only, ``dB' = G^T S_j`` the rank's
partial sum). Every partial gradient is completed by the adapter-gradient sum over the factor's holders
(``grad_sync``), as a replicated LoRA factor's is. Each rank keeps the whole pair (``r (K_max + N_max)`` numbers a
task, one LoRA layer's worth).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

LAMBDA_B = "vera_lambda_b"
"""The output vector's factor name: PEFT's (``...q_proj.vera_lambda_b`` in an adapter file)."""
LAMBDA_D = "vera_lambda_d"
"""The rank vector's factor name: PEFT's (``...q_proj.vera_lambda_d``)."""
VECTORS = (LAMBDA_D, LAMBDA_B)
"""A VeRA adapter's trained tensors on each layer it targets."""
PROJECTIONS = ("vera_A", "vera_B")
"""The frozen pair's names in an adapter file (``base_model.vera_A``, ``base_model.vera_B``)."""


def projection_dims(shapes: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """``(K_max, N_max)``: the widest input and output over the ``(in, out)`` shapes of the targeted projections
    (PEFT's ``VeraModel._find_dim``)."""
    shapes = list(shapes)
    if not shapes:
        raise ValueError("a VeRA adapter needs at least one targeted projection")
    return max(i for i, _ in shapes), max(o for _, o in shapes)


def _kaiming_uniform(shape: tuple[int, int], generator: torch.Generator) -> Tensor:
    """PEFT's ``vera.model._kaiming_init``: uniform on ``±sqrt(3) * sqrt(2) / sqrt(fan_in)``, ``fan_in = shape[1]``."""
    bound = math.sqrt(3.0) * math.sqrt(2.0) / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def draw_projections(rank: int, prng_key: int, in_max: int, out_max: int) -> tuple[Tensor, Tensor]:
    """The frozen ``A (rank, in_max)`` and ``B (out_max, rank)``, fp32 on the host, as PEFT draws them."""
    generator = torch.Generator(device="cpu").manual_seed(prng_key)
    A = _kaiming_uniform((rank, in_max), generator)
    return A, _kaiming_uniform((out_max, rank), generator)


class VeraProjections(nn.Module):
    """One VeRA adapter's frozen ``A`` and ``B``, shared by every layer that holds the adapter (non-persistent
    buffers ``vera_A``, ``vera_B``: see the module doc)."""

    def __init__(self, A: Tensor, B: Tensor) -> None:
        super().__init__()
        if A.shape[0] != B.shape[1]:
            raise ValueError(f"VeRA projections A {tuple(A.shape)} and B {tuple(B.shape)} differ in rank")
        self.register_buffer("vera_A", A, persistent=False)
        self.register_buffer("vera_B", B, persistent=False)

    def extra_repr(self) -> str:
        return f"A={tuple(self.vera_A.shape)}, B={tuple(self.vera_B.shape)}"


@dataclass(frozen=True)
class ProjectionSlice:
    """The part of the projections one layer (one TP rank's shard of it) uses: the rows of ``B`` in the order its
    local output holds them, and the columns of ``A``."""

    rows: tuple[tuple[int, int], ...]
    """``[start, stop)`` ranges of ``B``'s rows, laid end to end (a fused projection's shard: one per part)."""
    cols: tuple[int, int]
    """``[start, stop)`` of ``A``'s columns."""

    @classmethod
    def whole(cls, in_features: int, out_features: int) -> ProjectionSlice:
        """An unsplit layer's: ``A_K = A[:, :K]``, ``B_N = B[:N]``."""
        return cls(((0, out_features),), (0, in_features))

    def of(self, projections: VeraProjections) -> tuple[Tensor, Tensor]:
        """``(A_K, B_N)`` of this slice (views, or one cat of a fused shard's rows)."""
        B = projections.vera_B
        rows = [B[a:b] for a, b in self.rows]
        return projections.vera_A[:, self.cols[0] : self.cols[1]], rows[0] if len(rows) == 1 else torch.cat(rows)


def effective_factors(A: Tensor, B: Tensor, lambda_d: Tensor, lambda_b: Tensor) -> tuple[Tensor, Tensor]:
    """``A' = diag(λ_d) A``, ``B' = diag(λ_b) B`` in the vectors' dtype (differentiable in the vectors only)."""
    return lambda_d[:, None] * A.to(lambda_d.dtype), lambda_b[:, None] * B.to(lambda_b.dtype)


def initial_vectors(rank: int, out_features: int, d_initial: float, dtype: torch.dtype) -> dict[str, Tensor]:
    """PEFT's ``reset_vera_parameters``: ``λ_d`` all ``d_initial``, ``λ_b`` zero."""
    return {LAMBDA_D: torch.full((rank,), d_initial, dtype=dtype), LAMBDA_B: torch.zeros(out_features, dtype=dtype)}


def shared_projections(
    shapes: Mapping[str, tuple[int, int]], targets: Sequence[str], rank: int, prng_key: int
) -> VeraProjections:
    """The projections of an adapter of ``rank`` targeting ``targets`` (module suffixes) in a model whose
    projections are ``shapes`` (``inject.projection_shapes`` of the whole model: name -> ``(in, out)``)."""
    chosen = [shape for name, shape in shapes.items() if name.rpartition(".")[2] in targets]
    return VeraProjections(*draw_projections(rank, prng_key, *projection_dims(chosen)))
