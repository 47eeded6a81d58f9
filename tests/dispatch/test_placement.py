"""``dispatch.placement``'s sorts: ``interleave``'s one stable argsort is the (group, key, owner) lexsort it is
defined by."""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.dispatch import placement
from lorafleet.dispatch.placement import interleave


def by_definition(shares: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """The owners sorted by (group, (t + 1/2) / shares[k], k), owner k's t-th item at that key."""
    owners = np.repeat(np.arange(shares.size), shares)
    t = np.arange(owners.size) - np.repeat(np.cumsum(shares) - shares, shares)
    keys = (t + 0.5) / shares[owners]
    sort_keys = (owners, keys) if groups is None else (owners, keys, groups[owners])
    return owners[np.lexsort(sort_keys)]


@pytest.mark.parametrize("exact", [placement.KEY_EXACT, 0.0])
def test_interleave_is_its_lexsort_on_random_shares_and_groups(monkeypatch, exact):
    """Shares with zeros and equal ratios (keys tied across owners: 1/2 of 1 and 3/2 of 3), groups of one owner to
    all of them; with ``KEY_EXACT`` 0 every grouped deal takes the lexsort path."""
    monkeypatch.setattr(placement, "KEY_EXACT", exact)
    rng = np.random.default_rng(0)
    for _ in range(300):
        shares = rng.integers(0, int(rng.choice([3, 10, 400])), int(rng.integers(1, 40)))
        groups = np.sort(rng.integers(0, int(rng.integers(1, 12)), shares.size))
        assert np.array_equal(interleave(shares), by_definition(shares, None))
        assert np.array_equal(interleave(shares, groups), by_definition(shares, groups))
    tied = np.array([1, 3, 5, 1])
    assert np.array_equal(interleave(tied, np.array([0, 0, 1, 1])), by_definition(tied, np.array([0, 0, 1, 1])))


def test_interleave_falls_back_to_the_lexsort_for_large_shares():
    """Shares whose keys ``group + key`` could no longer tell apart take the lexsort (same order)."""
    shares, groups = np.array([2**20, 2**20 - 1]), np.array([0, 3])
    assert float(shares.max()) ** 2 * 4 >= placement.KEY_EXACT
    assert np.array_equal(interleave(shares, groups), by_definition(shares, groups))
