"""The bucket DP is exact: it matches brute force over every boundary set, with weights and barriers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafleet.dispatch import bucketing
from lorafleet.dispatch.bucketing import bucket_of, candidate_lengths, optimal_buckets, optimal_buckets_by_count


def brute_force_padding(
    lengths: np.ndarray, weights: np.ndarray, n_buckets: int, alignment: int, barriers: list[int]
) -> float:
    """Least padding over every set of at most ``n_buckets`` boundaries drawn from the candidates."""
    cand = candidate_lengths(lengths, alignment, barriers)
    values = np.unique(cand)
    caps = np.unique(np.asarray(barriers, dtype=np.int64))
    best = np.inf
    for r in range(1, n_buckets + 1):
        for inner in itertools.combinations(values[:-1], r - 1):
            bounds = np.array([*inner, values[-1]])
            which = np.searchsorted(bounds, cand)
            # a bucket may not hold candidates on both sides of a barrier
            if any(np.unique(np.searchsorted(caps, cand[which == k])).size > 1 for k in range(bounds.size)):
                continue
            best = min(best, float(weights @ (bounds[which] - lengths)))
    return best


small_lengths = st.lists(st.integers(1, 300), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(
    lengths=small_lengths,
    n_buckets=st.integers(1, 4),
    alignment=st.sampled_from([1, 8, 16]),
    barriers=st.lists(st.integers(1, 300), max_size=2),
    data=st.data(),
)
def test_dp_matches_brute_force(lengths, n_buckets, alignment, barriers, data):
    lengths = np.array(lengths)
    weights = np.array(
        data.draw(st.lists(st.integers(1, 5), min_size=lengths.size, max_size=lengths.size)), dtype=float
    )
    expected = brute_force_padding(lengths, weights, n_buckets, alignment, barriers)
    if expected == np.inf:  # fewer buckets than barrier segments
        with pytest.raises(ValueError, match="barrier segments"):
            optimal_buckets(lengths, n_buckets, weights=weights, alignment=alignment, barriers=barriers)
        return
    result = optimal_buckets(lengths, n_buckets, weights=weights, alignment=alignment, barriers=barriers)
    assert result.padding_tokens == pytest.approx(expected, abs=1e-6)
    # the reported padding is what the boundaries really cost, and every length fits its bucket
    which = bucket_of(lengths, result.boundaries)
    assert np.all(which < len(result.boundaries))
    assert result.padding_tokens == pytest.approx(float(weights @ (np.array(result.boundaries)[which] - lengths)))
    assert list(result.boundaries) == sorted(set(result.boundaries))
    assert result.n_buckets <= n_buckets


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 2000), min_size=1, max_size=60), n_buckets=st.integers(1, 8))
def test_weights_equal_repeated_lengths(lengths, n_buckets):
    """The planner's weighted form (distinct lengths + counts) equals the DP over the repeated lengths."""
    values, counts = np.unique(lengths, return_counts=True)
    weighted = optimal_buckets(values, n_buckets, weights=counts)
    repeated = optimal_buckets(np.array(lengths), n_buckets)
    assert weighted.padding_tokens == pytest.approx(repeated.padding_tokens)
    assert weighted.tokens == repeated.tokens


def test_fractional_weights_scale_padding():
    lengths = np.array([100, 900, 1000, 3000])
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    by_prob = optimal_buckets(lengths, 2, weights=probs)
    by_count = optimal_buckets(lengths, 2, weights=probs * 1000)
    assert by_prob.boundaries == by_count.boundaries
    assert by_prob.padding_tokens * 1000 == pytest.approx(by_count.padding_tokens)
    assert by_prob.padding_ratio == pytest.approx(by_count.padding_ratio)


def test_candidates_are_aligned_and_capped_at_barriers():
    lengths = np.array([1, 16, 17, 2040, 2047, 2049])
    assert candidate_lengths(lengths, 16).tolist() == [16, 16, 32, 2048, 2048, 2064]
    assert candidate_lengths(np.array([2030, 2045]), 64, barriers=[2040]).tolist() == [2040, 2048]


def test_barriers_keep_buckets_within_one_memory_class():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9000, 400)
    result = optimal_buckets(lengths, 6, barriers=[2048, 4096, 16384])
    assert {2048, 4096} <= set(result.boundaries)


def test_by_count_gives_every_count_and_padding_never_grows():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 5000, 300)
    results = optimal_buckets_by_count(lengths, 12)
    assert [r.n_buckets for r in results] == list(range(1, 13))
    paddings = [r.padding_tokens for r in results]
    assert all(a >= b for a, b in itertools.pairwise(paddings))
    assert results[-1] == optimal_buckets(lengths, 12)


def test_more_buckets_than_distinct_lengths_and_empty_input():
    assert optimal_buckets(np.array([5, 5, 300]), 16).boundaries == (16, 304)
    empty = optimal_buckets(np.zeros(0, dtype=np.int64), 16)
    assert empty.boundaries == () and empty.padding_ratio == 0.0


def first_least_dp(u: np.ndarray, w: np.ndarray, segment: np.ndarray, n_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """The module docstring's recurrence over every k < i, in Python: F[j][i] and its first least k, for reachable
    states (the reference the banded DP's sums and ties are checked against)."""
    n = u.size
    cum = np.concatenate(([0.0], np.cumsum(w)))
    occupied = np.full((n_buckets + 1, n + 1), np.inf)
    occupied[0, 0] = 0.0
    choice = np.full((n_buckets + 1, n + 1), -1)
    for j in range(1, n_buckets + 1):
        for i in range(1, n + 1):
            least = np.inf
            for k in range(i):
                total = occupied[j - 1, k] + -u[i - 1] * cum[k]
                if segment[k] == segment[i - 1] and total < least:  # strictly: the first least k stays
                    least, choice[j, i] = total, k
            occupied[j, i] = least + u[i - 1] * cum[i]
    return occupied, choice


@settings(max_examples=120, deadline=None)
@given(
    candidates=st.lists(st.integers(1, 60), min_size=1, max_size=30, unique=True),
    weights=st.data(),
    n_buckets=st.integers(1, 6),
    barriers=st.lists(st.integers(1, 60), max_size=6),
    block=st.sampled_from([3, 7, 512]),
    gather=st.sampled_from([0, 2, 10**6]),
)
def test_the_banded_dp_is_the_dp_over_every_start(candidates, weights, n_buckets, barriers, block, gather):
    """Over each row's band of starts (its barrier segment's) or one row of starts for a block (``BAND_GATHER``: 0
    always the bands, 10**6 always one row), blocks of one segment or several: the same F, and the same first least
    start where a bucketing reaches the state (ties included: integer weights tie often)."""
    u = np.array(sorted(candidates), dtype=float)
    w = np.array(weights.draw(st.lists(st.integers(0, 3), min_size=u.size, max_size=u.size)), dtype=float)
    segment = np.searchsorted(np.unique(np.asarray(barriers, dtype=np.int64)), u, side="left")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bucketing, "_ROW_BLOCK", block)
        patch.setattr(bucketing, "BAND_GATHER", gather)
        occupied, choice = bucketing._occupied_tokens_dp(u, w, segment, n_buckets)
    expected, expected_choice = first_least_dp(u, w, segment, n_buckets)
    assert np.array_equal(occupied, expected)
    reached = np.isfinite(expected)
    reached[0] = False
    assert np.array_equal(choice[reached], expected_choice[reached])


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=40),
    barriers=st.lists(st.integers(1, 700), max_size=5, unique=True),
    alignment=st.sampled_from([1, 7, 16]),
    n_buckets=st.integers(1, 8),
)
def test_barriers_at_or_above_the_rounded_longest_length_change_no_bucketing(lengths, barriers, alignment, n_buckets):
    """The barriers ``acting_barriers`` drops give the same candidates, barrier segments present and buckets."""
    lengths = np.array(lengths)
    barriers = sorted(barriers)
    acting = bucketing.acting_barriers(lengths, alignment, barriers)
    np.testing.assert_array_equal(
        candidate_lengths(lengths, alignment, acting), candidate_lengths(lengths, alignment, barriers)
    )
    present = np.unique(np.searchsorted(barriers, lengths, side="left")).size
    assert np.unique(np.searchsorted(acting, lengths, side="left")).size == present
    count = max(n_buckets, present)
    with_all = optimal_buckets_by_count(lengths, count, alignment=alignment, barriers=barriers)
    assert optimal_buckets_by_count(lengths, count, alignment=alignment, barriers=acting) == with_all
