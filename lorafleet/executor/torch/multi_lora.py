"""Many LoRA adapters over one frozen linear layer: one base GEMM, one low-rank update per segment.

A micro-batch holds the tokens of several tasks. Flattened to rows ``X (T, K)``, segment ``j``
covers rows ``R_j = [start_j, start_j + L_j)`` and uses adapter ``a = a_j`` with
``A_a (r_a, K)``, ``B_a (N, r_a)``, scaling ``s_a`` and dropout ``p_a``. Rows in no segment
(padding) see only the base layer. With the frozen base weight ``W (N, K)`` and bias ``b``:

    Y       = X W^T + b                        (T, N)    one GEMM for every task
    Xd_j    = X[R_j] ⊙ M_j / (1 - p_a)         (L_j, K)  M_j: keep-mask drawn in the forward
    S_j     = Xd_j A_a^T                       (L_j, r_a) "shrink"
    Y[R_j] += s_a S_j B_a^T                    (L_j, N)  "expand"

and, with ``G = dLoss/dY``:

    dS_j    = s_a G[R_j] B_a                                   (L_j, r_a)
    dX      = G W + Σ_j into rows R_j: (dS_j A_a) ⊙ M_j / (1 - p_a)   one (T, K) buffer
    dA_a    = Σ_{j: a_j = a} dS_j^T Xd_j                       (r_a, K)
    dB_a    = Σ_{j: a_j = a} s_a G[R_j]^T S_j                  (N, r_a)

This is mLoRA's BatchLoRA operator (arXiv 2312.02515 §4) with two fixes: the backward reuses the
forward's dropout mask (mLoRA rescales the un-dropped input, so its gradients are exact only in
expectation), and the same adapter may own several segments.

Two implementations share one ``torch.autograd.Function``: a torch loop over runs of segments
(:func:`_torch_forward`, CPU and reference) and Triton kernels
(``kernels/segment_lora.py``, CUDA). :class:`LoraBackend` picks one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from lorafleet.specs.lora import LoraSpec


class LoraBackend(StrEnum):
    """Which implementation computes the segmented low-rank GEMMs."""

    TORCH = "torch"
    """A loop over runs of segments with ``torch.bmm``; any device."""
    TRITON = "triton"
    """Segmented Triton kernels; CUDA, or CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""
    AUTO = "auto"
    """TRITON for CUDA tensors, TORCH otherwise."""


@dataclass(frozen=True, slots=True)
class Segments:
    """Which rows of a flattened ``(T, K)`` micro-batch go through which adapter.

    Segment ``j`` covers rows ``[starts[j], starts[j] + lengths[j])`` and uses adapter
    ``adapter_ids[j]``. Segments are sorted by start and do not overlap; empty segments are
    allowed. Rows in no segment (padding) get no adapter. The fields are Python ints because the
    layout is known on the host before the forward: reading it never waits for the device.
    """

    adapter_ids: tuple[int, ...]
    """Adapter id of each segment (an adapter may own several segments)."""
    starts: tuple[int, ...]
    """First row of each segment, ascending."""
    lengths: tuple[int, ...]
    """Rows of each segment, >= 0."""

    def __post_init__(self) -> None:
        for name in ("adapter_ids", "starts", "lengths"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if not len(self.adapter_ids) == len(self.starts) == len(self.lengths):
            raise ValueError(
                f"Segments: adapter_ids, starts and lengths differ in length "
                f"({len(self.adapter_ids)}, {len(self.starts)}, {len(self.lengths)})"
            )
        end = 0
        for j, (adapter, start, length) in enumerate(self):
            if adapter < 0:
                raise ValueError(f"Segments.adapter_ids[{j}] = {adapter}: must be >= 0")
            if length < 0:
                raise ValueError(f"Segments.lengths[{j}] = {length}: must be >= 0")
            if start < end:
                raise ValueError(
                    f"Segments.starts[{j}] = {start}: segments must be sorted and not overlap "
                    f"(the previous one ends at row {end})"
                )
            end = start + length

    @classmethod
    def packed(cls, adapter_ids: Sequence[int], lengths: Sequence[int]) -> Segments:
        """Back-to-back segments from row 0: a packed micro-batch, one segment per sequence or task."""
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        return cls(tuple(adapter_ids), tuple(starts[: len(lengths)]), tuple(lengths))

    @classmethod
    def padded(cls, adapter_ids: Sequence[int], lengths: Sequence[int], seq_len: int) -> Segments:
        """A right-padded ``(B, seq_len)`` batch: sequence ``b`` owns its first ``lengths[b]`` rows."""
        return cls(tuple(adapter_ids), tuple(b * seq_len for b in range(len(lengths))), tuple(lengths))

    @property
    def end(self) -> int:
        """One past the last covered row; the flattened input needs at least this many rows."""
        return self.starts[-1] + self.lengths[-1] if self.starts else 0

    def __len__(self) -> int:
        return len(self.adapter_ids)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """Yields ``(adapter_id, start, length)`` per segment."""
        return zip(self.adapter_ids, self.starts, self.lengths, strict=True)

    def relabel(self, local: Mapping[int, int]) -> Segments:
        """Keeps the segments whose adapter is in ``local`` and renames it ``local[adapter]``."""
        kept = [(local[a], s, n) for a, s, n in self if a in local]
        return Segments(*zip(*kept, strict=True)) if kept else Segments((), (), ())


@dataclass(frozen=True, slots=True)
class LoraRouting:
    """One layer call's routing: the segments, and per adapter (by position) its scaling and dropout."""

    segments: Segments
    """Row segments; ``adapter_ids`` index ``scalings``, ``dropouts`` and the weight lists."""
    scalings: tuple[float, ...]
    """``s_a``: alpha / r, or alpha / sqrt(r) for rsLoRA (:attr:`LoraSpec.scaling`)."""
    dropouts: tuple[float, ...]
    """``p_a`` in [0, 1): the keep-mask rows of adapter ``a`` are scaled by ``1 / (1 - p_a)``."""

    def __post_init__(self) -> None:
        for name in ("scalings", "dropouts"):  # tuples: a routing is a cache key (see _runs)
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if len(self.scalings) != len(self.dropouts):
            raise ValueError(f"LoraRouting: {len(self.scalings)} scalings but {len(self.dropouts)} dropouts")
        if any(a >= len(self.scalings) for a in self.segments.adapter_ids):
            raise ValueError(f"LoraRouting: a segment names an adapter >= {len(self.scalings)}")
        if not all(0.0 <= p < 1.0 for p in self.dropouts):
            raise ValueError(f"LoraRouting.dropouts = {self.dropouts}: each must be in [0, 1)")


def draw_keep_mask(rows: int, cols: int, routing: LoraRouting, *, device: torch.device | str) -> Tensor | None:
    """The dropout keep-mask ``M (rows, cols)`` (bool): Bernoulli(1 - p_a) on adapter ``a``'s rows.

    Rows of adapters without dropout, and padding rows, are all True. Returns None when no
    non-empty segment has dropout, so the common p = 0 case allocates nothing. The mask is one
    byte per element. Both backends save it instead of each adapter's dropped input (what an
    ``nn.Dropout`` per adapter would keep alive: 4 bytes an element) and reapply it in the
    backward, which so uses exactly the forward's mask and recomputes ``Xd``.
    """
    spans = _dropout_spans(routing)
    if not spans:
        return None
    keep = torch.empty((rows, cols), dtype=torch.bool, device=device)
    done = 0  # rows [0, done) are written
    for first, end, p in spans:
        if first > done:
            keep[done:first] = True
        _draw_keep_rows(keep[first:end], p)
        done = end
    if rows > done:
        keep[done:] = True
    return keep


def _dropout_spans(routing: LoraRouting) -> list[tuple[int, int, float]]:
    """``(first row, end row, p)`` of each span of consecutive non-empty segments sharing one
    p > 0: one Bernoulli draw per span (a packed batch with one dropout rate is one span).
    Padding rows inside a span are drawn too, harmlessly."""
    spans: list[tuple[int, int, float]] = []
    previous_p = 0.0
    for a, start, length in routing.segments:
        if not length:
            continue
        p = routing.dropouts[a]
        if p and p == previous_p:
            spans[-1] = (spans[-1][0], start + length, p)
        elif p:
            spans.append((start, start + length, p))
        previous_p = p
    return spans


_DRAW_CHUNK = 1 << 17
"""int64 random words per draw of :func:`_draw_keep_rows` (1 MiB, reused, read back from cache
by the compare: measured ~10% cheaper than 8 MiB chunks)."""


def _draw_keep_rows(keep: Tensor, p: float) -> None:
    """Fills the contiguous bool rows ``keep`` with Bernoulli(1 - p) from the global torch RNG.

    Bernoulli(1 - p) is ``u >= t`` on uniform 16-bit integers ``u``, ``t = -2^15 + round(p 2^16)``:
    P(drop) is ``round(p 2^16) / 2^16``, within 2^-17 of p (a float32 uniform, what
    ``nn.Dropout`` compares, resolves 2^-24; LoRA dropout rates are 0.05-0.1, and a p below
    2^-17 rounds to no dropout). The int16s are the raw bits of a quarter as many int64s drawn
    over the full range (``random_(-2^63, None)``: no modulo, so ~20% cheaper than naming the
    upper bound); measured on CPU, 16-bit draws cost ~60% of 32-bit ones, which cost ~80% of
    ``rand`` + compare (itself ~35% cheaper than ``bernoulli_``). They are drawn into one reused
    1 MiB buffer, not one temporary of the mask's size: on CPU a fresh multi-MiB temporary
    costs a page fault per 4 KiB. The CPU generator fills elements in order, so the chunks draw
    exactly the words one full-range ``random_`` over the whole span would.
    """
    flat = keep.view(-1)
    n = flat.numel()
    threshold = min(-(2**15) + round(p * 2**16), 2**15 - 1)
    words = torch.empty(min((n + 3) // 4, _DRAW_CHUNK), dtype=torch.int64, device=keep.device)
    for first in range(0, n, 4 * _DRAW_CHUNK):
        count = min(4 * _DRAW_CHUNK, n - first)  # int16s; a tail uses part of its last word
        bits = words[: (count + 3) // 4].random_(-(2**63), None).view(torch.int16)[:count]
        torch.ge(bits, threshold, out=flat[first : first + count])


def multi_lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Sequence[Tensor],
    lora_B: Sequence[Tensor],
    routing: LoraRouting,
    keep: Tensor | None = None,
    backend: LoraBackend = LoraBackend.AUTO,
) -> Tensor:
    """``Y = X W^T + b`` plus each segment's ``s_a B_a A_a (X ⊙ M / (1-p_a))``; see the module doc.

    Args:
        x: ``(T, K)`` rows of the micro-batch.
        weight: ``(N, K)`` frozen base weight (must not require grad); ``bias``: ``(N,)`` or None.
        lora_A: per adapter ``A_a (r_a, K)``; ``lora_B``: per adapter ``B_a (N, r_a)``; any float dtype
            (fp32 masters over a bf16 ``x``): the low-rank GEMMs run in ``x``'s dtype, the
            gradients come back in each weight's own.
        routing: segments (indexing ``lora_A``) and per-adapter scaling and dropout.
        keep: ``(T, K)`` bool keep-mask (:func:`draw_keep_mask`), or None for no dropout.
        backend: implementation; AUTO is Triton on CUDA, torch elsewhere.

    Returns:
        ``(T, N)``. Gradients flow to ``x`` and to every ``A_a``, ``B_a`` (None for an adapter
        that owns no rows), never to ``weight`` or ``bias``.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("multi_lora_linear: the base weight and bias must be frozen (requires_grad=False)")
    if x.dim() != 2 or routing.segments.end > x.shape[0]:
        raise ValueError(f"multi_lora_linear: x {tuple(x.shape)} must be (T, K) with T >= {routing.segments.end}")
    if len(lora_A) != len(routing.scalings) or len(lora_B) != len(routing.scalings):
        raise ValueError(f"multi_lora_linear: routing has {len(routing.scalings)} adapters, got {len(lora_A)} A, {len(lora_B)} B")
    backend = LoraBackend(backend)
    if backend is LoraBackend.AUTO:
        backend = LoraBackend.TRITON if x.is_cuda else LoraBackend.TORCH
    return _MultiLoraFunction.apply(x, weight, bias, routing, keep, backend, *lora_A, *lora_B)


class _MultiLoraFunction(torch.autograd.Function):
    """Autograd glue: one saved bool keep-mask, one dX buffer, per-backend forward/backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, routing, keep, backend, *lora):
        n = len(lora) // 2
        forward_impl, _ = _implementation(backend)
        y, saved = forward_impl(x, weight, bias, lora[:n], lora[n:], routing, keep)
        ctx.routing, ctx.backend, ctx.n_adapters = routing, backend, n
        ctx.save_for_backward(x, weight, keep, *lora, *saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, keep, *rest = ctx.saved_tensors
        n = ctx.n_adapters
        lora_A, lora_B, saved = rest[:n], rest[n : 2 * n], rest[2 * n :]
        need_x, need_lora = ctx.needs_input_grad[0], any(ctx.needs_input_grad[6:])
        _, backward_impl = _implementation(ctx.backend)
        dx, dA, dB = backward_impl(grad_y, x, weight, lora_A, lora_B, ctx.routing, keep, saved, need_x, need_lora)
        dA = [g if g is None else g.to(w.dtype) for g, w in zip(dA, lora_A, strict=True)]  # compute -> master dtype
        dB = [g if g is None else g.to(w.dtype) for g, w in zip(dB, lora_B, strict=True)]
        return dx, None, None, None, None, None, *dA, *dB


def _implementation(backend: LoraBackend):
    """(forward, backward) of a backend, both with the signatures of the torch pair below."""
    if backend is LoraBackend.TORCH:
        return _torch_forward, _torch_backward
    # Imported on first use, not at module import, so CPU-only runs never import triton (and
    # never fix TRITON_INTERPRET for the process: triton.jit reads it when it decorates, and
    # triton.language decorates its own helpers when triton is first imported).
    from lorafleet.executor.torch.kernels import segment_lora

    return segment_lora.forward, segment_lora.backward


# ---- torch backend ------------------------------------------------------------------------------


def stack_padded(weights: Sequence[Tensor], dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """``(G, ...)`` stack of LoRA weights zero-padded along their rank ``dim`` to the largest
    rank ``R`` among them, in ``dtype`` (the compute dtype; default: the weights').

    ``A (r, K)`` pads rows (``dim=0``): ``(G, R, K)``. ``B (N, r)`` pads columns (``dim=1``):
    ``(G, N, R)``, for mixed ranks a strided view of one ``(N, G R)`` block. The padding is
    exact: padded rows of ``A`` give zero columns of ``S``, which meet zero columns of ``B``, so
    adapters of different ranks share one batched GEMM; :func:`unstack_padded` cuts their
    gradients back. Mixed ranks take two ops whatever G (this runs every layer call): one
    ``cat`` along the rank and one ``index_copy_`` of its ``Σ r`` slices into the zeroed stack
    (:func:`_padded_slots`); measured ~40% cheaper than ``pad_sequence``.
    """
    dtype = dtype or weights[0].dtype
    ranks = tuple(w.shape[dim] for w in weights)
    if all(r == ranks[0] for r in ranks):
        return torch.stack(list(weights)).to(dtype)
    width = weights[0].shape[1 - dim]
    slots = _padded_slots(ranks, weights[0].device)
    if dim == 0:
        out = weights[0].new_zeros((len(ranks) * max(ranks), width), dtype=dtype)
        return out.index_copy_(0, slots, torch.cat(list(weights)).to(dtype)).view(len(ranks), max(ranks), width)
    out = weights[0].new_zeros((width, len(ranks) * max(ranks)), dtype=dtype)
    out.index_copy_(1, slots, torch.cat(list(weights), dim=1).to(dtype))
    return out.view(width, len(ranks), max(ranks)).permute(1, 0, 2)


def unstack_padded(stacked: Tensor, ranks: Sequence[int], *, transpose: bool = False) -> list[Tensor]:
    """Member ``g``'s first ``ranks[g]`` rows of a rank-padded ``(G, R, C)`` stack, ``(r_g, C)``
    each, or their transposes ``(C, r_g)`` with ``transpose`` (how ``dB`` comes out: computed as
    ``(G, R, N)``, measured ~25% faster than ``(G, N, R)``).

    Equal ranks are unbound (transposed: after one copy of the whole stack, so every member is
    contiguous and autograd takes it as the gradient of an ``(N, r)`` parameter as it is);
    mixed ones are gathered by one ``index_select`` and split.
    """
    ranks = tuple(int(r) for r in ranks)
    if all(r == stacked.shape[1] for r in ranks):
        return list((stacked.transpose(1, 2).contiguous() if transpose else stacked).unbind(0))
    rows = stacked.reshape(-1, stacked.shape[2]).index_select(0, _padded_slots(ranks, stacked.device))
    return [m.T for m in rows.split(ranks)] if transpose else list(rows.split(ranks))


@functools.lru_cache(maxsize=256)
def _padded_slots(ranks: tuple[int, ...], device: torch.device) -> Tensor:
    """Indices ``g R + i`` (``i < r_g``) of the real rows among a padded stack's ``G R``."""
    padded = max(ranks)
    return torch.tensor([g * padded + i for g, r in enumerate(ranks) for i in range(r)], device=device)


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive segments of equal length with equally spaced starts: their rows of any
    ``(T, C)`` tensor form one strided ``(G, L, C)`` view, so each GEMM of the module doc is
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


SPLIT_BREAK_EVEN = 4_000_000
"""Padded multiply-adds worth one more run on CPU: a run costs ~16 more small ops (~0.1 ms of
dispatch), about what the six LoRA GEMMs spend on this many zero-padded multiply-adds."""


@functools.lru_cache(maxsize=1024)
def _runs(routing: LoraRouting, ranks: tuple[int, ...], width: int) -> tuple[_Run, ...]:
    """Greedily merges consecutive non-empty segments into :class:`_Run` s, then splits a run
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
        _Run(
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


TILE_BYTES = 1 << 20
"""Size of one ``(members, rows, K)`` tile of the K-wide temporaries of the masked products
(1 MiB, inside a 2-4 MiB L2 cache)."""


@functools.lru_cache(maxsize=1024)
def _tiles(run: _Run, width: int, itemsize: int) -> tuple[tuple[slice, slice], ...]:
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


def _dropping(run: _Run, keep: Tensor | None) -> bool:
    """Whether this call drops anything on the run (a mask, and p > 0 for some member)."""
    return keep is not None and any(run.dropouts)


class _MaskTiles:
    """The masked K-wide products of one run, a tile at a time (:func:`_tiles`).

    ``X ⊙ M`` and ``(dS' A) ⊙ M`` are never materialised whole: each tile converts its bytes
    of the bool mask into a reused float scratch tile (read through a uint8 view, which
    converts vectorised, ~3x faster than from bool) and multiplies there. The tiles stay in
    cache between the elementwise op and the GEMM that reads them, no K-wide temporary is
    allocated per call (on CPU a fresh multi-MiB buffer costs a page fault per 4 KiB), and
    only the 1-byte mask is saved for the backward. A run that is one tile (short segments,
    where per-op overhead dominates) is neither sliced nor given a scratch.
    """

    def __init__(self, run: _Run, keep: Tensor, x: Tensor) -> None:
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


def _run_factor(run: _Run, dropping: bool, like: Tensor) -> float | Tensor:
    """``c = s / (1 - p)`` per member when the run drops (``keep_g`` not None), else ``s``.

    It folds the scaling and inverted dropout's ``1 / (1 - p)`` into one multiply of a
    rank-wide tensor in the forward (``c S``) and one in the backward (``c G B``).
    """
    if not dropping:
        return _per_member(run.scalings, like)
    return _per_member(tuple(s / (1.0 - p) for s, p in zip(run.scalings, run.dropouts, strict=True)), like)


def _accumulate(grads: list[Tensor | None], adapters: tuple[int, ...], members: Sequence[Tensor]) -> None:
    """Adds each member's gradient to that of ``adapters[i]`` (an adapter may recur in a run or across runs)."""
    for a, grad in zip(adapters, members, strict=True):
        grads[a] = grad if grads[a] is None else grads[a] + grad


def _torch_forward(x, weight, bias, lora_A, lora_B, routing, keep):
    """Returns ``(Y, saved)``; ``saved`` holds per run ``(c S, A_g, B_g)`` for the backward.

    With ``c = s / (1 - p)`` (:func:`_run_factor`), ``c (X ⊙ M) A^T = s Xd A^T = s S``: the
    expand input and, saved, the right factor of ``dB = G^T (s S)``.
    """
    y = F.linear(x, weight, bias)  # (T, N): the one base GEMM
    saved = []
    for run in _runs(routing, tuple(a.shape[0] for a in lora_A), x.shape[1] + weight.shape[0]):
        A_g, B_g = run.stacked(lora_A, lora_B, x.dtype)  # (G, R, K), (G, N, R)
        dropping = _dropping(run, keep)
        if dropping:
            s_g = _MaskTiles(run, keep, x).shrink(A_g)  # (G, L, R) = (X ⊙ M) A^T
        else:
            s_g = torch.bmm(run.rows(x), A_g.transpose(1, 2))  # (G, L, R) = X A^T
        s_g.mul_(_run_factor(run, dropping, x))  # s S
        run.rows(y).baddbmm_(s_g, B_g.transpose(1, 2))  # (G, L, N) += s S B^T, in the base output
        saved += (s_g, A_g, B_g)
    return y, saved


def _torch_backward(grad_y, x, weight, lora_A, lora_B, routing, keep, saved, need_x, need_lora):
    """Returns ``(dX or None, dA per adapter, dB per adapter)``; see the module doc for the math.

    With ``c = s / (1 - p)``, ``dS' = c G B = dS / (1 - p)`` serves both products that need
    ``dS``: ``dA = dS^T Xd = dS'^T (X ⊙ M)`` and ``(dS A) ⊙ M / (1 - p) = (dS' A) ⊙ M``.
    """
    dx = grad_y.mm(weight) if need_x else None  # (T, N) @ (N, K): the single dX buffer
    dA: list[Tensor | None] = [None] * len(lora_A)
    dB: list[Tensor | None] = [None] * len(lora_B)
    for i, run in enumerate(_runs(routing, tuple(a.shape[0] for a in lora_A), x.shape[1] + weight.shape[0])):
        s_g, A_g, B_g = saved[3 * i : 3 * i + 3]  # (G, L, R), (G, R, K), (G, N, R)
        g_g = run.rows(grad_y)  # (G, L, N)
        dropping = _dropping(run, keep)
        ds_g = torch.bmm(g_g, B_g).mul_(_run_factor(run, dropping, x))  # (G, L, R) = c G B
        dx_g = run.rows(dx) if need_x else None  # (G, L, K) view: written in place
        if dropping:
            dA_g = _MaskTiles(run, keep, x).backward(ds_g, A_g, dx_g, need_lora)
        else:
            dA_g = torch.bmm(ds_g.transpose(1, 2), run.rows(x)) if need_lora else None  # (G, R, K)
            if dx_g is not None:
                dx_g.baddbmm_(ds_g, A_g)  # += dS A
        if need_lora:
            ranks = [lora_A[a].shape[0] for a in run.adapters]
            _accumulate(dA, run.adapters, unstack_padded(dA_g, ranks))
            dBt_g = torch.bmm(s_g.transpose(1, 2), g_g)  # (G, R, N) = (s G^T S)^T
            _accumulate(dB, run.adapters, unstack_padded(dBt_g, ranks, transpose=True))
    return dx, dA, dB


# ---- the module ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _layer_routing(
    segments: Segments, ids: tuple[int, ...], scalings: tuple[float, ...], dropouts: tuple[float, ...]
) -> LoraRouting:
    """Routing of a layer holding adapters ``ids``; cached because every layer of a model with the
    same adapters asks for the same one in each step (and equal routings share :func:`_runs`)."""
    return LoraRouting(segments.relabel({a: i for i, a in enumerate(ids)}), scalings, dropouts)


def adapter_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype adapters are kept in over a base of ``base_dtype``: fp32 over a 16-bit base
    (master weights, as PEFT's ``autocast_adapter_dtype``: optimizer updates of ~1e-4 relative
    size would round away in bf16's 8-bit mantissa), the base's own otherwise. The low-rank
    GEMMs still run in the activations' dtype (the stacked copies are cast, the gradients cast
    back), so a bf16 step costs bf16 GEMMs and fp32 only for the tiny weights."""
    return torch.float32 if base_dtype in (torch.bfloat16, torch.float16) else base_dtype


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` (kept as ``base_layer``) plus any number of LoRA adapters.

    Adapters are keyed by integer id (a task slot); ``lora_A[str(id)]`` is ``(r, in_features)``
    and ``lora_B[str(id)]`` is ``(out_features, r)``, as in PEFT's ``lora_A.<name>.weight``. A
    forward needs :attr:`segments` (set for every layer of a model by
    ``inject.segments_context``) to know which rows use which adapter; segments naming an id
    this layer lacks (a task that does not target this module) are treated as padding.

    Example:
        >>> layer = MultiLoraLinear(nn.Linear(64, 32))
        >>> layer.add_adapter(0, LoraSpec(rank=8, alpha=16))
        >>> layer.add_adapter(1, LoraSpec(rank=4, alpha=4, dropout=0.1))
        >>> layer.segments = Segments.packed([0, 1], [5, 3])
        >>> layer(torch.randn(8, 64)).shape
        torch.Size([8, 32])
    """

    def __init__(self, base_layer: nn.Linear, *, backend: LoraBackend = LoraBackend.AUTO) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"MultiLoraLinear wraps nn.Linear, got {type(base_layer).__name__}")
        self.base_layer = base_layer.requires_grad_(False)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.adapters: dict[int, LoraSpec] = {}
        """Spec of each adapter id present in this layer."""
        self.backend = LoraBackend(backend)
        self.segments: Segments | None = None
        """Row segments of the current forward; None outside a segments context."""

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def add_adapter(self, adapter_id: int, spec: LoraSpec, weights: tuple[Tensor, Tensor] | None = None) -> None:
        """Creates (or replaces) adapter ``adapter_id``.

        Without ``weights`` it is initialised as PEFT does: A Kaiming-uniform (a = sqrt(5)),
        B zero, so the adapter starts as the identity update. With ``weights = (A, B)`` they are
        copied into the adapter dtype (:func:`adapter_dtype`) on the base layer's device. A base
        on the ``meta`` device (the skeleton of per-stage loading, materialised later) gets real
        adapters on the host: they are small, and every rank must draw the same whole ones.
        """
        base = self.base_layer.weight
        device = torch.device("cpu") if base.is_meta else base.device
        shape_A, shape_B = (spec.rank, self.in_features), (self.out_features, spec.rank)
        A = torch.empty(shape_A, dtype=adapter_dtype(base.dtype), device=device)
        B = torch.zeros(shape_B, dtype=adapter_dtype(base.dtype), device=device)
        if weights is None:
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
        else:
            if tuple(weights[0].shape) != shape_A or tuple(weights[1].shape) != shape_B:
                raise ValueError(
                    f"adapter {adapter_id}: weights {tuple(weights[0].shape)}, {tuple(weights[1].shape)} "
                    f"do not match A {shape_A}, B {shape_B}"
                )
            A.copy_(weights[0])
            B.copy_(weights[1])
        key = str(adapter_id)
        self.lora_A[key], self.lora_B[key] = nn.Parameter(A), nn.Parameter(B)
        self.adapters[adapter_id] = spec

    def remove_adapter(self, adapter_id: int) -> None:
        """Drops adapter ``adapter_id`` from this layer if present."""
        if self.adapters.pop(adapter_id, None) is not None:
            del self.lora_A[str(adapter_id)], self.lora_B[str(adapter_id)]

    def routing(self) -> LoraRouting:
        """The current segments in this layer's terms: adapter ``i`` is the i-th of :attr:`adapters`."""
        if self.segments is None:
            raise RuntimeError(
                "MultiLoraLinear needs row segments: run the model inside "
                "segments_context(model, segments), or set layer.segments"
            )
        specs = self.adapters.values()
        return _layer_routing(
            self.segments, tuple(self.adapters), tuple(s.scaling for s in specs), tuple(s.dropout for s in specs)
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x (..., in_features) -> (..., out_features)``; leading dims flatten to the segment rows."""
        routing = self.routing()
        x2 = x.reshape(-1, self.in_features)  # (T, K), T = prod(leading dims)
        keep = draw_keep_mask(*x2.shape, routing, device=x2.device) if self.training else None
        # The dicts' own parameter maps, in adapter order (add_adapter inserts into both dicts
        # and self.adapters alike): ParameterDict.__getitem__ costs ~0.7 us a key, every call.
        y = multi_lora_linear(
            x2,
            self.base_layer.weight,
            self.base_layer.bias,
            list(self.lora_A._parameters.values()),
            list(self.lora_B._parameters.values()),
            routing,
            keep,
            self.backend,
        )
        return y.view(*x.shape[:-1], self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        ranks = ", ".join(f"{i}: r={s.rank}" for i, s in self.adapters.items())
        return f"adapters={{{ranks}}}, backend={self.backend.value}"
