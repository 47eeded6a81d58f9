"""Dynamic bucketing: the padding-minimising choice of at most R bucket boundaries.

A sequence of length l is padded to the smallest boundary >= l. Candidate boundaries are
the lengths rounded up to the alignment ``a`` (LobRA uses a = 16), capped at the next
*barrier* (a config's max tokens M, so no bucket straddles a memory limit and every
bucket stays eligible for every config that can hold its sequences)::

    u(l) = min(ceil(l / a) * a, min{M in barriers : M >= l})

Let u_1 < ... < u_U be the distinct candidates of the step, w_k the weight (count) of the
sequences with candidate u_k and W_i = w_1 + ... + w_i. A bucket covering candidates
k+1..i has boundary u_i and occupies u_i * (W_i - W_k) tokens. With F[j][i] the fewest
occupied tokens for the first i candidates in exactly j buckets::

    F[0][0] = 0,   F[0][i > 0] = inf
    F[j][i] = min over k < i, (k, i] within one barrier segment, of  F[j-1][k] + u_i * (W_i - W_k)

and the padding of j buckets is F[j][U] - sum_k w_k l_k. Sequences with equal candidate
always share a bucket in an optimum, so this DP over U distinct candidates gives the same
optimum as LobRA's DP over all n sequences, in O(R U^2) time instead of O(R n^2). The
inner minimum is one vectorised numpy reduction per (j, block of i).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BAND_GATHER = 3
"""A block of the DP reads each row's band of k by a gather only where one row of k for all would be more than this
times as wide: a gathered entry costs two to three broadcast ones (a few wide segments read one row: LobRA 7B's ~150
candidates in 2-4 segments, service-sweeps' ~220 in 5; a service-scale plan's ~390 in 13-15 segments, the bands;
at 2, service-sweeps' steps took the bands and 1.04-1.06x the base's DP)."""
_ROW_BLOCK = 256
"""Rows i of the DP evaluated at once: bounds the temporary (block x band) matrix for large U, and a block reads k
up to its own last i, so one barrier segment of U candidates reads ~5/8 of the U x U square in two blocks, not all
of it (a service-scale step's ~390 candidates: 0.7-0.8x of the DP's time over 512-row blocks)."""


@dataclass(frozen=True)
class BucketingResult:
    """Bucket boundaries of one DP solution and the padding they cost."""

    boundaries: tuple[int, ...]
    """Ascending upper lengths: a sequence goes to the first boundary >= its length."""
    padding_tokens: float
    """Sum over sequences of weight * (boundary - length): alignment padding included."""
    tokens: float
    """Sum over sequences of weight * length."""

    @property
    def n_buckets(self) -> int:
        return len(self.boundaries)

    @property
    def padding_ratio(self) -> float:
        """Padding over all occupied tokens (LobRA's padding ratio)."""
        total = self.tokens + self.padding_tokens
        return self.padding_tokens / total if total else 0.0


def candidate_lengths(lengths: np.ndarray, alignment: int = 16, barriers: Sequence[int] = ()) -> np.ndarray:
    """u(l) for every length: rounded up to ``alignment``, capped at the next barrier >= l."""
    lengths = np.asarray(lengths, dtype=np.int64)
    aligned = -(-lengths // alignment) * alignment
    caps = np.unique(np.asarray(barriers, dtype=np.int64))
    if caps.size == 0:
        return aligned
    nxt = np.searchsorted(caps, lengths, side="left")
    capped = np.where(nxt < caps.size, caps[np.minimum(nxt, caps.size - 1)], aligned)
    return np.minimum(aligned, capped)


def acting_barriers(lengths: np.ndarray, alignment: int, barriers: Sequence[int]) -> list[int]:
    """``barriers`` (ascending) less those at or above the longest length rounded up to ``alignment``: such a barrier
    caps no candidate and separates none (every aligned length, and so every ``u(l)``, is at most that rounded length,
    hence at most the barrier), so the candidates, their barrier segments (as a partition) and the buckets of every
    count are those without it."""
    if lengths.size == 0:
        return list(barriers)
    top = -(-int(lengths.max()) // alignment) * alignment
    return [b for b in barriers if b < top]


def bucket_of(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Index of each length's bucket: the first boundary >= the length."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), np.asarray(lengths, dtype=np.int64), side="left")


def optimal_buckets(
    lengths: np.ndarray,
    n_buckets: int = 16,
    *,
    weights: np.ndarray | None = None,
    alignment: int = 16,
    barriers: Sequence[int] = (),
) -> BucketingResult:
    """The least-padding boundaries with at most ``n_buckets`` buckets.

    Args:
        lengths: sequence lengths (tokens), any order; or distinct lengths with ``weights``.
        n_buckets: R, the most buckets allowed.
        weights: count (or probability) of each entry of ``lengths``; 1 each when omitted.
            The planner passes an expected length distribution this way.
        alignment: candidate boundaries are multiples of this (tokens), or barriers.
        barriers: lengths no bucket may straddle (the configs' max tokens M).

    Raises:
        ValueError: ``n_buckets`` is below the number of barrier segments the lengths occupy.
    """
    return optimal_buckets_by_count(lengths, n_buckets, weights=weights, alignment=alignment, barriers=barriers)[-1]


def optimal_buckets_by_count(
    lengths: np.ndarray,
    max_buckets: int,
    *,
    weights: np.ndarray | None = None,
    alignment: int = 16,
    barriers: Sequence[int] = (),
) -> tuple[BucketingResult, ...]:
    """The least-padding boundaries for every feasible bucket count up to ``max_buckets``, fewest first.

    One DP gives them all: entry ``j`` of the answer is the optimum with exactly
    ``min_buckets + j`` buckets, where ``min_buckets`` is the number of barrier segments the
    lengths occupy (1 without barriers). More buckets than distinct candidates are never
    useful, so the last entry has ``min(max_buckets, U)`` buckets. Same arguments as
    :func:`optimal_buckets`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    w = np.ones(lengths.size) if weights is None else np.asarray(weights, dtype=float)
    if w.shape != lengths.shape:
        raise ValueError(f"weights has shape {w.shape}, lengths {lengths.shape}")
    keep = w > 0
    lengths, w = lengths[keep], w[keep]
    # a count each: the integer sum, which is w @ lengths to the bit (every partial sum an integer below 2**53),
    # without numpy's mixed float-integer product (~1.5 ms on a service-scale step's 15,360 lengths)
    tokens = float(lengths.sum()) if weights is None else float(w @ lengths)
    if lengths.size == 0:
        return (BucketingResult((), 0.0, 0.0),)
    cand = candidate_lengths(lengths, alignment, barriers)
    u, inverse = np.unique(cand, return_inverse=True)
    wu = np.bincount(inverse, weights=w, minlength=u.size)
    caps = np.unique(np.asarray(barriers, dtype=np.int64))
    segment = np.searchsorted(caps, u, side="left")
    min_buckets = int(np.unique(segment).size)
    if max_buckets < min_buckets:
        raise ValueError(f"{max_buckets} buckets cannot separate lengths spanning {min_buckets} barrier segments")
    top = min(max_buckets, u.size)
    occupied, choice = _occupied_tokens_dp(u.astype(float), wu, segment, top)
    return tuple(
        BucketingResult(
            boundaries=tuple(int(x) for x in u[_backtrack(choice, j, u.size)]),
            padding_tokens=max(float(occupied[j, u.size]) - tokens, 0.0),
            tokens=tokens,
        )
        for j in range(min_buckets, top + 1)
    )


def _occupied_tokens_dp(
    u: np.ndarray, w: np.ndarray, segment: np.ndarray, n_buckets: int
) -> tuple[np.ndarray, np.ndarray]:
    """F[j][i] (fewest occupied tokens, see module docstring) and the argmin k, for j <= n_buckets.

    Prefix index i counts candidates: F[j][i] covers u[0:i]. The cost splits as
    u_i * W_i - u_i * W_k; the first term is outside the min, the second is built per block
    of rows i, over the band of k a bucket ending at u[i - 1] may start at: k from the first
    candidate of u[i - 1]'s barrier segment, ``first(i)``, to i - 1. Row i reads
    k = first(i) + t for t < the block's widest band (a gather), or, where the block's k from its
    least first(i) to its last i - 1 are at most :data:`BAND_GATHER` times as many, that one
    row of k for all (a slice); either way a k outside [first(i), i) is masked (inf). Within a
    row the k ascend, so the first least entry is the one a row over every k (the others inf)
    gives: the same argmin, the same sums (a band is its segment's width, not U: ~0.3 of the
    entries at service scale, 13-15 barriers). A state no bucketing reaches (F = inf) keeps an
    argmin no backtrack reads.
    """
    n = u.size
    cum = np.concatenate(([0.0], np.cumsum(w)))  # W_0..W_U
    last_seg = np.concatenate(([-1], segment))  # segment of u[i - 1], the last candidate of prefix i
    seg_first = np.searchsorted(segment, last_seg, side="left")  # first(i): where that segment starts
    # a prefix spanning s segments needs s buckets: j buckets reach the prefixes up to the end of the j-th segment
    # (reach[j]), the others stay inf
    reach = np.append(np.flatnonzero(np.diff(segment)) + 1, n)
    reach = np.concatenate(([0], reach, np.full(n_buckets, n)))[: n_buckets + 1].tolist()
    occupied = np.full((n_buckets + 1, n + 1), np.inf)
    occupied[0, 0] = 0.0
    choice = np.zeros((n_buckets + 1, n + 1), dtype=np.int64)
    for lo in range(1, n + 1, _ROW_BLOCK):
        hi = min(lo + _ROW_BLOCK, n + 1)
        rows = np.arange(lo, hi)
        first = seg_first[rows]
        # (block, t): k = first(i) + t over each row's band; or one row of k from the block's least first(i) to its
        # last i - 1, read as a slice, where that is at most BAND_GATHER times as wide (a gather costs that much more)
        low, band, across = int(first[0]), int((rows - first).max()), int(rows[-1] - first[0])
        one_row = across <= BAND_GATHER * band
        # one row: k = low + t (t < across, all below n); bands: the masked past n read anything in range
        ks = low + np.arange(across)[None, :] if one_row else np.minimum(first[:, None] + np.arange(band), n)
        # bucket (k, i] holds u[k..i-1], in u[i - 1]'s segment from first(i) on; k < i
        valid = (ks >= first[:, None]) & (ks < rows[:, None])
        minus_uw = np.where(valid, -u[rows - 1][:, None] * cum[ks], np.inf)
        uw_i = u[rows - 1] * cum[rows]
        every = np.arange(rows.size)
        for j in range(1, n_buckets + 1):
            m = min(max(reach[j] - lo + 1, 0), rows.size)  # the block's rows j buckets reach: its first m
            if m == 0:
                continue
            total = (occupied[j - 1, None, low : low + across] if one_row else occupied[j - 1, ks[:m]]) + minus_uw[:m]
            best = np.argmin(total, axis=1)
            occupied[j, lo : lo + m] = total[every[:m], best] + uw_i[:m]
            choice[j, lo : lo + m] = best if one_row else ks[every[:m], best]
        if one_row:
            choice[1:, rows] += low  # t -> k
    return occupied, choice


def _backtrack(choice: np.ndarray, n_buckets: int, n: int) -> np.ndarray:
    """Indices into u of the boundaries of the optimum with ``n_buckets`` buckets over all n candidates."""
    ends = []
    i = n
    for j in range(n_buckets, 0, -1):
        ends.append(i - 1)
        i = int(choice[j, i])
    return np.array(ends[::-1], dtype=np.int64)
