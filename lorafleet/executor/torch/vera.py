"""VeRA (Kopiczko et al., 2024, arXiv 2310.11454) in the multi-adapter operator: a LoRA whose factors are frozen.

A VeRA adapter has one pair of frozen random projections for the whole model, ``A (r, K_max)`` and
``B (N_max, r)`` (``K_max``, ``N_max``: the widest input and output of the linears it targets), and per targeted
layer ``(N, K)`` two trained vectors ``λ_d (r,)`` and ``λ_b (N,)``. As PEFT 0.21's ``vera.Linear.forward``:

    Y = X W^T + b + λ_b ⊙ ((λ_d ⊙ (Xd A_K^T)) B_N^T)       A_K = A[:, :K],  B_N = B[:N, :]

no alpha scaling. The multi-adapter operator (``multi_lora``) runs a call's VeRA tenants beside its LoRA and DoRA
tenants, after the one base GEMM, on the same keep-mask, in place in the same ``Y`` and ``dX`` buffers, by runs of
equally spaced equal-length segments (one ``bmm`` per product, ``kernels.torch_lora``'s runs) as PEFT's function
does it, not as a LoRA with effective factors ``diag(λ_d) A_K`` and ``diag(λ_b) B_N`` (:func:`update`)::

    S0 = Xd A_K^T         S1 = S0 ⊙ λ_d          Y += S1 B'^T,   B' = diag(λ_b) B_N

and, with ``G = dLoss/dY`` on the tenant's rows (:func:`update_backward`)::

    dS1 = G B'            dλ_d = colsum(dS1 ⊙ S0)        dX += ((dS1 ⊙ λ_d) A_K) ⊙ M / (1 - p)
    dλ_b = rowsum((G^T S1) ⊙ B_N)

``dλ_d = rowsum(dA' ⊙ A_K)`` with ``dA' = dS1^T Xd`` (the chain rule through ``A' = diag(λ_d) A_K``) is the same
sum taken over rows instead of the ``K`` columns, so the ``(r, K)`` weight-gradient GEMM a LoRA tenant needs
(``T r K`` multiply-adds) is never made, nor ``A'``: a VeRA tenant's backward has three low-rank GEMMs where a
LoRA one has four. ``dλ_b`` still needs ``G^T S1`` ``(N, r)``: its other form, ``colsum(G ⊙ S1 B_N^T)``, would save
a ``(T, N)`` activation a layer (PEFT's autograd keeps it). Nothing reaches ``A`` or ``B``.

**The projections** (:func:`draw_projections`) are PEFT's: a CPU ``torch.Generator`` seeded with
``projection_prng_key``, ``A`` then ``B`` from it, each Kaiming-uniform with bound ``sqrt(6 / fan_in)``
(``fan_in`` = ``K_max`` for ``A``, ``r`` for ``B``). ``K_max`` and ``N_max`` are over the *whole* model's targeted
projections (:func:`projection_dims`), so every pipeline stage draws the same pair whatever layers it keeps.
Every layer of a model holding one VeRA adapter refers to one :class:`VeraProjections` (a child module shared by
the layers, so ``.to(device)`` moves it once); its buffers are not persistent: an adapter file stores them once,
as PEFT's ``save_projection=True`` does (``peft_export``), and a checkpoint redraws them from the key.

**Tensor parallelism** (``tp.py``). A layer keeps which rows of ``B_N`` and which columns of ``A_K`` its shard uses
(:class:`ProjectionSlice`): a column-parallel layer all of ``A_K`` and its output rows of ``B_N`` (``λ_b`` split
with them, ``λ_d`` replicated: its gradient is partial on each rank, ``dλ_d = Σ_j colsum(dS1_j ⊙ S0)`` with
``dS1_j = G_j B'_j``); a row-parallel layer its input columns of ``A_K`` and all of ``B_N`` (``λ_d`` and ``λ_b``
replicated, both gradients partial: ``S0_j = Xd_j A_{K_j}^T`` covers the columns ``K_j`` only, and ``G^T S1_j`` is
the rank's partial sum). Every partial gradient is completed by the adapter-gradient sum over the factor's holders
(``grad_sync``), as a replicated LoRA factor's is. Each rank keeps the whole pair (``r (K_max + N_max)`` numbers a
task, one LoRA layer's worth).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lorafleet.executor.torch.kernels.stacking import stack_padded

# The torch backend's runs and masked tiles (kernels/torch_lora.py documents them).
from lorafleet.executor.torch.kernels.torch_lora import (
    MaskTiles,
    Run,
    accumulate_grads,
    run_drops,
    run_factor,
    segment_runs,
)
from lorafleet.executor.torch.routing import LoraRouting

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


@dataclass(frozen=True)
class VeraTenants:
    """A layer call's VeRA adapters, as the operator takes them: their own routing (segments and dropouts; scaling 1)
    and per adapter, in its order, the frozen slices ``A_K (r, K)``, ``B_N (N, r)`` and the trained ``λ_d``,
    ``λ_b``."""

    routing: LoraRouting
    A: Sequence[Tensor]
    B: Sequence[Tensor]
    lambda_d: Sequence[Tensor]
    lambda_b: Sequence[Tensor]


def _runs_of(routing: LoraRouting, A: Sequence[Tensor], width: int) -> tuple[Run, ...]:
    """The runs of the tenants' segments, as the torch backend groups a LoRA call's (``width``: ``K + N``)."""
    return segment_runs(routing, tuple(a.shape[0] for a in A), width)


def update(x: Tensor, y: Tensor, keep: Tensor | None, tenants: VeraTenants) -> list[Tensor]:
    """Adds every VeRA tenant's ``S1 B'^T`` to its rows of ``y (T, N)`` in place (the module doc), and returns per run
    what :func:`update_backward` needs: ``S0 (G, L, R)``, the stacked ``A_K (G, R, K)``, ``B' (G, N, R)`` and
    ``λ_d (G, 1, R)``, ranks zero-padded to the run's largest (copies in ``x``'s dtype: another micro-batch may step
    the vectors in place before this one's backward)."""
    saved: list[Tensor] = []
    for run in _runs_of(tenants.routing, tenants.A, x.shape[1] + y.shape[1]):
        A_g = stack_padded([tenants.A[a] for a in run.adapters], 0, x.dtype)  # (G, R, K)
        d_g = stack_padded([tenants.lambda_d[a][None] for a in run.adapters], 1, x.dtype)  # (G, 1, R)
        b_g = _scaled_B(tenants, run, A_g.shape[1], x.dtype)  # (G, N, R) = diag(λ_b) B_N
        dropping = run_drops(run, keep)
        if dropping:
            s0 = MaskTiles(run, keep, x).shrink(A_g)  # (G, L, R) = (X ⊙ M) A^T
        else:
            s0 = torch.bmm(run.rows(x), A_g.transpose(1, 2))  # (G, L, R) = X A^T
        s0.mul_(run_factor(run, dropping, x))  # Xd A^T: the factor is 1 / (1 - p), VeRA's scaling 1
        run.rows(y).baddbmm_(s0 * d_g, b_g.transpose(1, 2))  # (G, L, N) += S1 B'^T
        saved += (s0, A_g, b_g, d_g)
    return saved


def _scaled_B(tenants: VeraTenants, run: Run, rank: int, dtype: torch.dtype) -> Tensor:
    """``B' = diag(λ_b) B_N`` of the run's members, ``(G, N, R)`` zero-padded to ``rank``: one pass over each ``B_N``
    (no plain stack of it: the backward reads the members' own slices)."""
    members = [(tenants.B[a], tenants.lambda_b[a]) for a in run.adapters]
    out_features = members[0][0].shape[0]
    make = torch.empty if all(B.shape[1] == rank for B, _ in members) else torch.zeros
    out = make((len(members), out_features, rank), dtype=dtype, device=members[0][0].device)
    for g, (B, lambda_b) in enumerate(members):
        torch.mul(B, lambda_b[:, None], out=out[g, :, : B.shape[1]])
    return out


def update_backward(
    grad_y: Tensor, dx: Tensor | None, keep: Tensor | None, tenants: VeraTenants, saved: Sequence[Tensor]
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Adds every VeRA tenant's ``dX`` to its rows of ``dx`` in place (when given) and returns ``dλ_d``, ``dλ_b`` per
    adapter in the vectors' dtypes (None for an adapter with no rows; the module doc's equations). No input is
    read: ``S0`` is saved, and ``A`` is frozen (no ``dA = dS^T Xd``), so the operator saves no ``X`` for VeRA."""
    lambda_d, lambda_b = tenants.lambda_d, tenants.lambda_b
    d_grads: list[Tensor | None] = [None] * len(lambda_d)
    b_grads: list[Tensor | None] = [None] * len(lambda_b)
    width = tenants.A[0].shape[1] + grad_y.shape[1] if tenants.A else 0  # K + N, as update groups the runs
    for i, run in enumerate(_runs_of(tenants.routing, tenants.A, width)):
        s0, A_g, b_g, d_g = saved[4 * i : 4 * i + 4]
        g_g = run.rows(grad_y)  # (G, L, N)
        ds1 = torch.bmm(g_g, b_g)  # (G, L, R) = G B'
        dd_g = (ds1 * s0).sum(1)  # (G, R) = colsum(dS1 ⊙ S0)
        dbp_g = torch.bmm(g_g.transpose(1, 2), s0 * d_g)  # (G, N, R) = G^T S1
        if dx is not None:
            dropping = run_drops(run, keep)
            ds0 = ds1.mul_(d_g * run_factor(run, dropping, dx))  # dS1 ⊙ λ_d / (1 - p)
            if dropping:  # the mask tiles read their shapes off dX (same as X's): they compute dX alone
                MaskTiles(run, keep, dx).backward(ds0, A_g, run.rows(dx), need_lora=False)
            else:
                run.rows(dx).baddbmm_(ds0, A_g)
        members = [(g, tenants.B[a], lambda_d[a], lambda_b[a]) for g, a in enumerate(run.adapters)]
        # (N,) each: rowsum((G^T S1) ⊙ B_N), in place in G^T S1; an adapter may own segments in several runs
        db = [dbp_g[g, :, : B.shape[1]].mul_(B.to(dbp_g.dtype)).sum(1).to(b.dtype) for g, B, _, b in members]
        accumulate_grads(d_grads, run.adapters, [dd_g[g, : d.shape[0]].to(d.dtype) for g, _, d, _ in members])
        accumulate_grads(b_grads, run.adapters, db)
    return d_grads, b_grads


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
