"""Time of a micro-batch on one layer and one pipeline stage, and the affine terms around it.

Per transformer layer and TP degree, one micro-batch of ``b`` sequences padded to ``s``
tokens takes (LobRA, Appendix D, Eq. 10)::

    t(b, s) = (c1*b + c2)*s^2 + (c3*b + c4)*s + (c5*b + c6)            [ms]

Reading the terms physically: ``c1*b*s^2`` is attention (quadratic in each sequence's
length), ``c3*b*s`` every projection (linear in the tokens), ``c5*b`` per-sequence work and
``c6`` per-micro-batch fixed cost (kernel launches, weight reads). ``c2*s^2`` and ``c4*s``
are shared by all rows of the micro-batch and scale with its *longest* row: work done once
per micro-batch per position (rotary tables, masks) and the under-filled attention and GEMM
tiles of a short batch.

A *packed* micro-batch of sequences s_1..s_n (S = Σ s_i tokens, attention kept inside each
sequence by a variable-length kernel) therefore costs::

    t_pack(s_1..s_n) = c1*Σ s_i^2 + c2*max_i s_i^2 + c3*S + c4*max_i s_i + c5*n + c6

attention from the individual lengths, projections from the total tokens, the shared terms
from the longest sequence. With all n = b sequences of length s this is exactly t(b, s): a
padded micro-batch without padding costs what the same sequences packed cost. Both forms are
the inner product of the coefficients with one feature row (``shape_features``), so padded
and packed measurements fit together.

A model with sliding-window layers meets fewer keys than causal attention's s(s+1)/2 (``attention_span``): with
a span its attention column is ``Σ s_i^2 ρ(s_i)``, ρ(s) = (1 - f) + f K_w(s) / K(s) the share of causal
attention's key positions a block meets, 1 for s <= w. Without a span (every layer global) it is Σ s_i^2 as
above, bit for bit. The fit (``fit``) takes no span: the profiler measures a window-free stand-in of the model
(``profiling.replica``), so a fitted c1 is global attention's, and the cost model applies the model's windows
where it prices a stage (``CostModel.stage_coeffs``), for fitted and analytic coefficients alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import chain, repeat
from operator import attrgetter

import numpy as np

from lorafleet.costmodel.attention_span import AttentionSpan

N_COEFFS = 6
GB = 1e9
MS_PER_S = 1e3

#: Share of each coefficient of a block's forward+backward that is forward, so the extra cost of
#: re-running the forward under activation recomputation. From the analytic model's terms (frozen
#: base): causal attention's backward is 2.5x its forward (c1, c2: 2/7); the projections' input
#: gradient GEMMs equal their forward ones (no weight gradients), the TP all-reduces and the
#: elementwise passes come two forward, two backward, and the weights are read once each way
#: (c3..c6: 1/2). ``benchmarks/bench_recompute.py`` measures the factor on this CPU.
FORWARD_SHARE = (2 / 7, 2 / 7, 1 / 2, 1 / 2, 1 / 2, 1 / 2)


@dataclass(frozen=True)
class MicroBatchShape:
    """What the cost model needs of a micro-batch: its sequences' lengths and how they are laid out."""

    seq_lens: tuple[int, ...]
    """Unpadded length of every sequence in the micro-batch."""
    padded_len: int | None = None
    """Bucket length every sequence is padded to; ``None`` for a packed micro-batch."""

    @classmethod
    def padded(cls, b: int, s: int) -> MicroBatchShape:
        """``b`` sequences that fill the bucket length ``s`` (how profiles describe a padded micro-batch)."""
        return cls((s,) * b, s)

    @classmethod
    def packed(cls, seq_lens: Sequence[int]) -> MicroBatchShape:
        return cls(tuple(int(n) for n in seq_lens), None)

    @property
    def n_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def tokens(self) -> int:
        """Tokens the micro-batch occupies (padding included): what must fit in max tokens M."""
        if self.padded_len is None:
            return int(sum(self.seq_lens))
        return self.padded_len * len(self.seq_lens)


def shape_features(mb: MicroBatchShape, span: AttentionSpan | None = None) -> np.ndarray:
    """Feature row x with t = x @ c: [Σ s_i^2, max s_i^2, Σ s_i, max s_i, n, 1] over the rows as computed
    (each padded row counts as ``padded_len``); for a padded (b, s) this is [b s^2, s^2, b s, s, b, 1]. With a
    ``span`` the first is Σ s_i^2 ρ(s_i) (module docstring)."""
    return features_of([mb], span)[0]


def features_of(mbs: Sequence[MicroBatchShape], span: AttentionSpan | None = None) -> np.ndarray:
    """``(len(mbs), 6)``: :func:`shape_features` of every micro-batch in one pass (segment sums and
    maxima over their concatenated lengths), what prices a replica's step and fits a profile;
    an empty micro-batch gives a zero row. The fields are read by C getters (``map``), not a generator a
    micro-batch: a dispatched step prices its replicas' thousands of micro-batches; :class:`LaidOutShapes` bring
    those lengths along, and nothing is read of the micro-batches."""
    if isinstance(mbs, LaidOutShapes):
        counts, lens = mbs.row_counts, mbs.row_lengths
    else:
        counts, lens = np.fromiter(map(_N_SEQS, mbs), dtype=np.int64, count=len(mbs)), None
    out = np.zeros((len(mbs), N_COEFFS))
    held = counts > 0
    starts = counts.cumsum() - counts
    if not held.all():  # empty micro-batches own no lengths, so skipping them is exact
        starts = starts[held]
    if not starts.size:
        return out
    if lens is None:
        lens = _row_lengths(mbs, int(counts.sum()))
    longest = np.maximum.reduceat(lens, starts)
    features = out if starts.size == out.shape[0] else np.empty((starts.size, N_COEFFS))
    features[:, 0] = np.add.reduceat(lens**2 if span is None else lens**2 * span.ratio(lens), starts)
    features[:, 1] = longest**2
    features[:, 2] = np.add.reduceat(lens, starts)
    features[:, 3] = longest
    features[:, 4] = counts[held] if features is not out else counts
    features[:, 5] = 1.0
    if features is not out:
        out[held] = features
    return out


def _row_lengths(mbs: Sequence[MicroBatchShape], total: int) -> np.ndarray:
    """Every row's length as computed (a padded row's is ``padded_len``), the micro-batches' concatenated: float."""
    pads = list(map(_PADDED_LEN, mbs))
    rows = (
        chain.from_iterable(map(_SEQ_LENS, mbs))
        if pads.count(None) == len(pads)
        else chain.from_iterable(
            mb.seq_lens if pad is None else repeat(pad, mb.n_seqs) for mb, pad in zip(mbs, pads, strict=True)
        )
    )
    return np.fromiter(rows, dtype=float, count=total)


class LaidOutShapes(list):
    """A list of micro-batch shapes with what :func:`features_of` reads of them: ``row_lengths``, every row's length
    as computed (float), the micro-batches' concatenated in order, and ``row_counts``, each one's rows (int64).
    A maker that holds them as arrays already (the dispatcher's packer) hands them on, so the features are not read
    back a micro-batch at a time. Not to be changed once made: the arrays would no longer describe the list."""

    __slots__ = ("row_counts", "row_lengths")

    def __init__(self, shapes: Iterable[MicroBatchShape], row_lengths: np.ndarray, row_counts: np.ndarray) -> None:
        super().__init__(shapes)
        if not len(self) == row_counts.size or row_lengths.size != int(row_counts.sum()):
            raise ValueError(f"{len(self)} shapes, {row_counts.size} row counts, {row_lengths.size} row lengths")
        self.row_lengths, self.row_counts = row_lengths, row_counts


_N_SEQS, _PADDED_LEN, _SEQ_LENS = attrgetter("n_seqs"), attrgetter("padded_len"), attrgetter("seq_lens")


@dataclass(frozen=True)
class LayerTimeCoeffs:
    """The six LobRA coefficients c1..c6 of one TP degree, in milliseconds per layer (or per stage), and the
    sliding windows their attention term meets (module docstring)."""

    c: tuple[float, float, float, float, float, float]
    span: AttentionSpan | None = None
    """The windowed blocks' window and share; None: every block global (c1 s^2)."""

    def __post_init__(self) -> None:
        if len(self.c) != N_COEFFS:
            raise ValueError(f"need {N_COEFFS} coefficients, got {len(self.c)}")

    def __call__(self, b: np.ndarray | float, s: np.ndarray | float) -> np.ndarray | float:
        """t(b, s) in ms (vectorised over numpy arrays; t(0, s) = 0: an empty fragment costs nothing)."""
        c1, c2, c3, c4, c5, c6 = self.c
        b = np.asarray(b, dtype=float)
        s = np.asarray(s, dtype=float)
        if self.span is not None:
            c1 = c1 * self.span.ratio(s)
        # (c1 b + c2) s^2 + (c3 b + c4) s + (c5 b + c6), summed in that order: the first product is a new array of
        # the result's shape (of b and s together), which the others are added to in place (a thousands-long s: a
        # load model's lengths, a replica's)
        t = (c1 * b + c2) * s**2
        t += (c3 * b + c4) * s
        t += c5 * b + c6
        if b.ndim or not b > 0:  # one b > 0 for every s (a load model's rows) leaves every time as it is
            t = np.where(b > 0, t, 0.0)
        return float(t) if t.ndim == 0 else t

    def packed(self, seq_lens: Sequence[int] | np.ndarray) -> float:
        """t_pack of one packed micro-batch, in ms (see the module docstring)."""
        return self.shape(MicroBatchShape.packed(np.asarray(seq_lens, dtype=int).tolist()))

    def shape(self, mb: MicroBatchShape) -> float:
        """Time of a micro-batch given by its shape, padded or packed, in ms."""
        return float(shape_features(mb, self.span) @ np.asarray(self.c))

    def shapes(self, mbs: Sequence[MicroBatchShape]) -> np.ndarray:
        """Times of many micro-batches, ms, in one matrix product (:func:`features_of`)."""
        return features_of(mbs, self.span) @ np.asarray(self.c)

    def windowed(self, span: AttentionSpan | None) -> LayerTimeCoeffs:
        """These coefficients over blocks of ``span`` (None: every block global)."""
        return replace(self, span=span)

    def global_floor(self) -> LayerTimeCoeffs:
        """Window-free coefficients whose time is never above these ones': c1 (1 - f), since ρ(s) >= 1 - f (the
        windowed blocks' attention left out); without a span, these. What a bound in LobRA's plain form takes."""
        if self.span is None:
            return self
        c1, *rest = self.c
        return LayerTimeCoeffs((c1 * (1 - self.span.windowed_share), *rest))

    def extended(self, factor: float, per_token: float = 0.0, fixed: float = 0.0) -> LayerTimeCoeffs:
        """``factor * t + per_token * tokens + fixed``, still in LobRA form (tokens = b*s adds to c3, fixed to c6).

        Used to turn per-layer coefficients into per-stage ones: L/pp layers plus the affine
        per-micro-batch terms (LM head, pipeline transfers) that LobRA leaves out.
        """
        c1, c2, c3, c4, c5, c6 = (factor * x for x in self.c)
        return LayerTimeCoeffs((c1, c2, c3 + per_token, c4, c5, c6 + fixed), self.span)

    def recomputed(self) -> LayerTimeCoeffs:
        """t(b, s) of the block under activation recomputation: c_i * (1 + FORWARD_SHARE_i)."""
        return LayerTimeCoeffs(tuple(c * (1 + share) for c, share in zip(self.c, FORWARD_SHARE)), self.span)

    def forward(self) -> LayerTimeCoeffs:
        """t(b, s) of the forward alone: c_i * FORWARD_SHARE_i (an evaluation's micro-batch: no backward)."""
        return LayerTimeCoeffs(tuple(c * share for c, share in zip(self.c, FORWARD_SHARE)), self.span)

    @staticmethod
    def design_row(b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Feature matrix X with t = X @ c for padded (b, s): columns b s^2, s^2, b s, s, b, 1."""
        b = np.asarray(b, dtype=float)
        s = np.asarray(s, dtype=float)
        return np.stack([b * s**2, s**2, b * s, s, b, np.ones_like(s)], axis=-1)


@dataclass(frozen=True)
class AffineTime:
    """``fixed + slope * x`` milliseconds: a cost linear in one size (tokens, parameters)."""

    fixed: float = 0.0
    """Milliseconds paid whatever the size."""
    slope: float = 0.0
    """Milliseconds per unit of size."""

    def __call__(self, x: np.ndarray | float) -> np.ndarray | float:
        x = np.asarray(x, dtype=float)
        t = np.where(x > 0, self.fixed + self.slope * x, 0.0)
        return float(t) if t.ndim == 0 else t


@dataclass(frozen=True)
class Link:
    """A point-to-point channel: latency plus bytes over bandwidth (Hockney's alpha-beta model)."""

    latency_ms: float = 0.0
    """Per-message start-up time, ms."""
    gb_per_s: float = float("inf")
    """Sustained bandwidth, GB/s (1e9 bytes per second), one direction."""

    def transfer(self) -> AffineTime:
        """One message, ms vs bytes: alpha + n / beta."""
        return AffineTime(self.latency_ms, MS_PER_S / (self.gb_per_s * GB))

    def allreduce(self, ranks: int) -> AffineTime:
        """Ring all-reduce over ``ranks``, ms vs bytes: 2(p-1) steps of n/p bytes each, i.e.
        2(p-1)*alpha + 2(p-1)/p * n / beta (free with one rank)."""
        return self._ring(2 * (ranks - 1), ranks)

    def reduce_scatter(self, ranks: int) -> AffineTime:
        """Ring reduce-scatter over ``ranks``, ms vs the bytes each rank contributes: p-1 steps of n/p bytes,
        i.e. (p-1)*alpha + (p-1)/p * n / beta, half the ring all-reduce (free with one rank)."""
        return self._ring(ranks - 1, ranks)

    def _ring(self, steps: int, ranks: int) -> AffineTime:
        """``steps`` messages of n/``ranks`` bytes in turn; free with one rank."""
        if ranks <= 1:
            return AffineTime()
        return AffineTime(steps * self.latency_ms, steps / ranks * MS_PER_S / (self.gb_per_s * GB))
