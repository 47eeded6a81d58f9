"""The torch backend of ``multi_lora``: every equation of its module doc as one ``bmm`` per run.

Consecutive segments of equal length at equal spacing form a *run* (:class:`Run`): their rows
of ``X``, ``Y``, ``G`` and ``dX`` are one strided ``(G, L, ·)`` view, so ``S = Xd A^T``,
``Y += s S B^T``, ``dS = s G B``, ``dX += (dS A) ⊙ M / (1 - p)``, ``dA = dS^T Xd`` and
``dB = s G^T S`` are one batched GEMM each per run, with ranks zero-padded to the run's largest
(:mod:`.stacking`). The inverted dropout is folded into one factor ``c = s / (1 - p)`` per
member (:func:`run_factor`), and the K-wide masked products are made a cache-sized tile at a
time (:class:`MaskTiles`). Any device; the reference the Triton kernels are tested against.

:func:`forward` and :func:`backward` have the signatures of ``segment_lora.forward`` and
``segment_lora.backward``: ``multi_lora._implementation`` picks one of the two modules.

The two constants below only change speed: they decide how the same products are grouped into
ops, never which products are computed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from lorafleet.executor.torch.kernels.stacking import stack_padded, unstack_padded
from lorafleet.executor.torch.routing import LoraRouting
from lorafleet.executor.torch.token_split import zero_missing

SPLIT_BREAK_EVEN = 4_000_000
"""Zero-padded multiply-adds worth one more run (:func:`_rank_pieces`): a CPU speed constant.

It trades wasted arithmetic against dispatch. A run of mixed ranks either stays one run, every
member padded to the largest rank (``row_width (G R_max - Σ_g r_g)`` multiply-adds of zeros per
GEMM pair), or is split into one run per rank, each extra run costing ~16 more small ops; it is
split when the padding exceeds this many multiply-adds per extra run. The figure was set in
334c544 from CPU timings: ~16 ops are ~0.1 ms of dispatch, about what the six LoRA GEMMs spend
on this many padded multiply-adds. It does not change results: padding contributes exact zeros,
so both groupings compute the same products, differing at most in the GEMMs' summation order
(the hypothesis oracle test runs every example also with this at 0, every mixed run split).
"""

TILE_BYTES = 1 << 20
"""Bytes of one ``(members, rows, K)`` tile of the masked products (:func:`_tiles`): a CPU
speed constant.

It trades per-tile op overhead (smaller tiles: more ``mul`` and ``bmm`` calls) against cache
misses: a 1 MiB tile stays in a 2-4 MiB L2 between the elementwise op that writes it and the
GEMM that reads it, and its reused scratch replaces the K-wide temporaries that page-faulted
(set in 8b8a99f: at 7B size and 2048 tokens per adapter a step then took 148 k minor page faults
against PEFT's 655 k, docs/multi_lora.md; no sweep of the size is recorded). It does not change
which products are computed: whole-member tiles give the same values, and row tiles, used only
for 4- and 8-byte dtypes, split the ``dA`` reduction into partial sums, i.e. change its
summation order (the oracle test runs tiles of 1 and 3 rows).
"""


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive segments of equal length with equally spaced starts: their rows of any
    ``(T, C)`` tensor form one strided ``(G, L, C)`` view, so each GEMM of ``multi_lora``'s module doc is
    one ``bmm`` per run instead of one ``mm`` per segment. That is what makes short segments
    cheap (per-op overhead dominates a 16-row GEMM). A packed micro-batch of equal-length
    sequences, or a padded batch whose sequences of one length sit ``seq_len`` rows apart, is
    one run whatever its adapters: ranks are zero-padded to the run's largest
    (:func:`stack_padded`), scalings and dropout rates become per-member factors."""

    adapters: tuple[int, ...]
    start: int
    length: int
    spacing: int
    scalings: tuple[float, ...]
    dropouts: tuple[float, ...]

    def rows(self, t: Tensor) -> Tensor:
        """The run's rows of a 2-D ``t (T, C)`` as a ``(G, L, C)`` view (no copy)."""
        return t.as_strided(
            (len(self.adapters), self.length, t.shape[1]),
            (self.spacing * t.stride(0), t.stride(0), t.stride(1)),
            t.storage_offset() + self.start * t.stride(0),
        )

    def stacked(self, lora_A: Sequence[Tensor], lora_B: Sequence[Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``A_g (G, R, K)`` and ``B_g (G, N, R)`` of the members in ``dtype``, R their largest rank."""
        return (
            stack_padded([lora_A[a] for a in self.adapters], 0, dtype),
            stack_padded([lora_B[a] for a in self.adapters], 1, dtype),
        )


@functools.lru_cache(maxsize=1024)
def segment_runs(routing: LoraRouting, ranks: tuple[int, ...], width: int) -> tuple[Run, ...]:
    """Greedily merges consecutive non-empty segments into :class:`Run` s, then splits a run
    of mixed ranks by rank where the zero padding costs more than the extra runs
    (:func:`_rank_pieces`); ``width`` is ``K + N``.

    Cached: every injected layer with the same adapters sees the same routing, in the forward
    and again in the backward.
    """
    open_runs: list[list] = []  # [adapters, first row, length, spacing]
    for a, start, length in routing.segments:
        if length == 0:
            continue
        if open_runs:
            adapters, first, prev_length, spacing = open_runs[-1]
            spacing = start - first if len(adapters) == 1 else spacing
            if length == prev_length and start == first + len(adapters) * spacing:
                adapters.append(a)
                open_runs[-1][3] = spacing
                continue
        open_runs.append([[a], start, length, length])
    return tuple(
        Run(
            members,
            first + piece[0] * spacing,
            length,
            (piece[1] - piece[0]) * spacing if len(piece) > 1 else length,
            tuple(routing.scalings[a] for a in members),
            tuple(routing.dropouts[a] for a in members),
        )
        for adapters, first, length, spacing in open_runs
        for piece in _rank_pieces([ranks[a] for a in adapters], length * width)
        for members in [tuple(adapters[i] for i in piece)]
    )


def _rank_pieces(member_ranks: list[int], row_width: int) -> list[list[int]]:
    """Positions in a run of the members to batch together: all of them (one ``bmm`` per GEMM,
    ranks zero-padded to the largest), or, when that padding costs more than the extra runs,
    the members of each rank cut into arithmetic progressions (equally spaced, so each piece
    is again one strided view).

    Padding costs ``row_width (G R_max - Σ_g r_g)`` multiply-adds per GEMM pair; each extra
    run costs :data:`SPLIT_BREAK_EVEN`.
    """
    by_rank: dict[int, list[int]] = {}
    for i, r in enumerate(member_ranks):
        by_rank.setdefault(r, []).append(i)
    pieces: list[list[int]] = []
    for positions in by_rank.values():
        pieces.append(positions[:1])
        for i in positions[1:]:
            piece = pieces[-1]
            if len(piece) == 1 or i - piece[-1] == piece[1] - piece[0]:
                piece.append(i)
            else:
                pieces.append([i])
    padding = row_width * (len(member_ranks) * max(member_ranks) - sum(member_ranks))
    if padding <= (len(pieces) - 1) * SPLIT_BREAK_EVEN:
        return [list(range(len(member_ranks)))]
    return pieces


def _per_member(values: tuple[float, ...], like: Tensor) -> float | Tensor:
    """One factor per run member: a float when they agree (the usual case), else ``(G, 1, 1)``."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, 1, 1)


@functools.lru_cache(maxsize=1024)
def _tiles(run: Run, width: int, itemsize: int) -> tuple[tuple[slice, slice], ...]:
    """``(members, rows)`` slices tiling a run's ``(G, L)`` grid into pieces of about
    :data:`TILE_BYTES` of a ``(G, L, width)`` tensor: whole members where one fits, else row
    blocks of one member. Row blocks split the ``dA`` reduction over rows, so they are used
    only for 4- and 8-byte dtypes: a bf16 partial sum per block would round each time.
    """
    member_bytes = run.length * width * itemsize
    if member_bytes <= TILE_BYTES or itemsize < 4:
        step = max(1, TILE_BYTES // member_bytes)
        return tuple((slice(g, g + step), slice(0, run.length)) for g in range(0, len(run.adapters), step))
    step = max(1, TILE_BYTES // (width * itemsize))
    return tuple(
        (slice(g, g + 1), slice(r, r + step)) for g in range(len(run.adapters)) for r in range(0, run.length, step)
    )


def run_drops(run: Run, keep: Tensor | None) -> bool:
    """Whether this call drops anything on the run (a mask, and p > 0 for some member)."""
    return keep is not None and any(run.dropouts)


class MaskTiles:
    """The masked K-wide products of one run, a tile at a time (:func:`_tiles`).

    ``X ⊙ M`` and ``(dS' A) ⊙ M`` are never materialised whole: each tile converts its bytes
    of the bool mask into a reused float scratch tile (read through a uint8 view, which
    converts vectorised, ~3x faster than from bool) and multiplies there. The tiles stay in
    cache between the elementwise op and the GEMM that reads them, no K-wide temporary is
    allocated per call (on CPU a fresh multi-MiB buffer costs a page fault per 4 KiB), and
    only the 1-byte mask is saved for the backward. A run that is one tile (short segments,
    where per-op overhead dominates) is neither sliced nor given a scratch.
    """

    def __init__(self, run: Run, keep: Tensor, x: Tensor) -> None:
        self.keep_g = run.rows(keep.view(torch.uint8))  # (G, L, K) bytes, 0/1
        self.x_g = run.rows(x)  # (G, L, K)
        self.tiles = _tiles(run, x.shape[1], x.element_size())
        self.whole = len(self.tiles) == 1
        members, rows = self.tiles[0]
        shape = (len(range(*members.indices(len(run.adapters)))), len(range(*rows.indices(run.length))), x.shape[1])
        self.scratch = None if self.whole else (x.new_empty(shape), x.new_empty(shape))  # mask, product

    def cut(self, t: Tensor, members: slice, rows: slice | None = None) -> Tensor:
        """A tile of a run-shaped ``(G, L, ·)`` tensor, or of a ``(G, ·, ·)`` one without ``rows``."""
        if self.whole:
            return t
        return t[members] if rows is None else t[members, rows]

    def __iter__(self) -> Iterator[tuple[slice, slice, Tensor, Tensor | None]]:
        """Yields ``(members, rows, M tile as 0/1 floats, product tile or None to allocate)``."""
        for members, rows in self.tiles:
            keep_t = self.cut(self.keep_g, members, rows)
            if self.scratch is None:
                yield members, rows, keep_t.to(self.x_g.dtype), None
                continue
            mask, product = (buf[: keep_t.shape[0], : keep_t.shape[1]] for buf in self.scratch)
            yield members, rows, mask.copy_(keep_t), product

    def shrink(self, A_g: Tensor) -> Tensor:
        """``(X ⊙ M) A^T`` ``(G, L, R)``."""
        s_g = self.x_g.new_empty((*self.x_g.shape[:2], A_g.shape[1]))
        for members, rows, mask, product in self:
            xm = torch.mul(self.cut(self.x_g, members, rows), mask, out=product)
            torch.bmm(xm, self.cut(A_g, members).transpose(1, 2), out=self.cut(s_g, members, rows))
        return s_g

    def backward(self, ds_g: Tensor, A_g: Tensor, dx_g: Tensor | None, need_lora: bool) -> Tensor | None:
        """``dX_g += (dS' A) ⊙ M`` in place (when ``dx_g`` is given); returns
        ``dS'^T (X ⊙ M)`` ``(G, R, K)`` when ``need_lora``, else None. A member's first row tile
        writes its ``dA`` rows, the next ones add to them."""
        dA_g = A_g.new_empty(A_g.shape) if need_lora else None
        for members, rows, mask, product in self:
            ds_t = self.cut(ds_g, members, rows)  # (g, l, R)
            if dA_g is not None:
                xm = torch.mul(self.cut(self.x_g, members, rows), mask, out=product)
                dA_t = self.cut(dA_g, members)
                if rows.start == 0:
                    torch.bmm(ds_t.transpose(1, 2), xm, out=dA_t)
                else:
                    dA_t.baddbmm_(ds_t.transpose(1, 2), xm)
            if dx_g is not None:
                product = torch.bmm(ds_t, self.cut(A_g, members), out=product)
                self.cut(dx_g, members, rows).addcmul_(product, mask)
        return dA_g


def run_factor(run: Run, dropping: bool, like: Tensor) -> float | Tensor:
    """``c = s / (1 - p)`` per member when the run drops (``keep_g`` not None), else ``s``.

    It folds the scaling and inverted dropout's ``1 / (1 - p)`` into one multiply of a
    rank-wide tensor in the forward (``c S``) and one in the backward (``c G B``).
    """
    if not dropping:
        return _per_member(run.scalings, like)
    return _per_member(tuple(s / (1.0 - p) for s, p in zip(run.scalings, run.dropouts, strict=True)), like)


def accumulate_grads(grads: list[Tensor | None], adapters: tuple[int, ...], members: Sequence[Tensor]) -> None:
    """Adds each member's gradient to that of ``adapters[i]`` (an adapter may recur in a run or across runs)."""
    for a, grad in zip(adapters, members, strict=True):
        grads[a] = grad if grads[a] is None else grads[a] + grad


def forward(x, weight, bias, lora_A, lora_B, routing: LoraRouting, keep):
    """Returns ``(Y, saved)``; ``saved`` holds per run ``(c S, A_g, B_g)`` for the backward.

    With ``c = s / (1 - p)`` (:func:`run_factor`), ``c (X ⊙ M) A^T = s Xd A^T = s S``: the
    expand input and, saved, the right factor of ``dB = G^T (s S)``.
    """
    y = F.linear(x, weight, bias)  # (T, N): the one base GEMM
    saved = []
    for run in segment_runs(routing, tuple(a.shape[0] for a in lora_A), x.shape[1] + weight.shape[0]):
        A_g, B_g = run.stacked(lora_A, lora_B, x.dtype)  # (G, R, K), (G, N, R)
        dropping = run_drops(run, keep)
        if dropping:
            s_g = MaskTiles(run, keep, x).shrink(A_g)  # (G, L, R) = (X ⊙ M) A^T
        else:
            s_g = torch.bmm(run.rows(x), A_g.transpose(1, 2))  # (G, L, R) = X A^T
        s_g.mul_(run_factor(run, dropping, x))  # s S
        run.rows(y).baddbmm_(s_g, B_g.transpose(1, 2))  # (G, L, N) += s S B^T, in the base output
        saved += (s_g, A_g, B_g)
    return y, saved


def backward(grad_y, x, weight, lora_A, lora_B, routing: LoraRouting, keep, saved, need_x, need_lora, share=None):
    """Returns ``(dX or None, dA per adapter, dB per adapter)``; see ``multi_lora``'s module doc for the math.

    With ``c = s / (1 - p)``, ``dS' = c G B = dS / (1 - p)`` serves both products that need
    ``dS``: ``dA = dS^T Xd = dS'^T (X ⊙ M)`` and ``(dS A) ⊙ M / (1 - p) = (dS' A) ⊙ M``.

    With ``share`` (a TP rank's token split, ``token_split.py``) ``x`` is None: each run's ``dS'`` is also written
    into the zero-padded ``(T, R_max)`` buffer the split reduce-scatters, and ``dA`` comes from the summed rows of
    this rank (:func:`weight_grads`) and its saved ``X`` rows; ``dX`` and ``dB`` are as without it.
    """
    dx = grad_y.mm(weight) if need_x else None  # (T, N) @ (N, K): the single dX buffer
    dA: list[Tensor | None] = [None] * len(lora_A)
    dB: list[Tensor | None] = [None] * len(lora_B)
    ranks = tuple(a.shape[0] for a in lora_A)
    width = weight.shape[1] + weight.shape[0]
    runs = segment_runs(routing, ranks, width)
    ds_all = share.buffer(max(ranks), grad_y) if share is not None and need_lora and runs else None
    local = need_lora and share is None  # dA from the whole saved x, here
    for i, run in enumerate(runs):
        s_g, A_g, B_g = saved[3 * i : 3 * i + 3]  # (G, L, R), (G, R, K), (G, N, R)
        g_g = run.rows(grad_y)  # (G, L, N)
        dropping = run_drops(run, keep)
        ds_g = torch.bmm(g_g, B_g).mul_(run_factor(run, dropping, grad_y))  # (G, L, R) = c G B
        if ds_all is not None:
            run.rows(ds_all)[:, :, : ds_g.shape[2]] = ds_g
        dx_g = run.rows(dx) if need_x else None  # (G, L, K) view: written in place
        dA_g = None
        if dropping and (local or dx_g is not None):
            # without x (a token split) the mask tiles read their shapes off dX and compute dX alone
            dA_g = MaskTiles(run, keep, x if local else dx).backward(ds_g, A_g, dx_g, local)
        elif not dropping:
            dA_g = torch.bmm(ds_g.transpose(1, 2), run.rows(x)) if local else None  # (G, R, K)
            if dx_g is not None:
                dx_g.baddbmm_(ds_g, A_g)  # += dS A
        if need_lora:
            member_ranks = [ranks[a] for a in run.adapters]
            if local:
                accumulate_grads(dA, run.adapters, unstack_padded(dA_g, member_ranks))
            dBt_g = torch.bmm(s_g.transpose(1, 2), g_g)  # (G, R, N) = (s G^T S)^T
            accumulate_grads(dB, run.adapters, unstack_padded(dBt_g, member_ranks, transpose=True))
    if ds_all is not None:
        dA = weight_grads(share.reduce(ds_all), share.x, share.keep, ranks, share.routing, width)
        zero_missing(dA, lora_A, routing, ds_all)
    return dx, dA, dB


def weight_grads(
    ds: Tensor, x: Tensor, keep: Tensor | None, ranks: Sequence[int], routing: LoraRouting, width: int
) -> list[Tensor | None]:
    """``dA_a = Σ dS'^T (X ⊙ M)`` over adapter ``a``'s rows of ``routing`` (``(r_a, K)``, None for an adapter with
    none): ``ds`` ``(T', R_max)`` holds ``dS' = c G B`` of every row, zero-padded to the largest rank, ``x`` and
    ``keep`` the same ``T'`` rows (a TP rank's share of them, ``token_split.py``), ``width`` the ``K + N`` the runs
    are grouped by (:func:`segment_runs`)."""
    dA: list[Tensor | None] = [None] * len(ranks)
    for run in segment_runs(routing, tuple(ranks), width):
        member_ranks = [ranks[a] for a in run.adapters]
        ds_g = run.rows(ds)[:, :, : max(member_ranks)]  # (G, L, R)
        if run_drops(run, keep):
            # MaskTiles.backward reads only the shape of A_g when it computes no dX: an expanded scalar
            shape = x.new_empty(()).expand(len(run.adapters), ds_g.shape[2], x.shape[1])
            dA_g = MaskTiles(run, keep, x).backward(ds_g, shape, None, True)
        else:
            dA_g = torch.bmm(ds_g.transpose(1, 2), run.rows(x))  # (G, R, K)
        accumulate_grads(dA, run.adapters, unstack_padded(dA_g, member_ranks))
    return dA
