"""``dispatch.sorting``: ``lexsort_ints`` is ``np.lexsort``'s order of integer keys, position for position, and
the radix order of small integers (``stable_argsort_ints``) is the stable argsort's."""

from __future__ import annotations

import numpy as np

from lorafleet.dispatch.sorting import LIMIT, RADIX, SMALL, lexsort_ints, stable_argsort_ints


def test_the_combined_argsort_is_lexsorts_order_on_random_integer_keys():
    """One to four keys of any signs and ranges, with ties (a few distinct values) and without, below and above
    ``SMALL`` keys (lexsort itself, the combination), and keys whose ranges' product passes the int64 limit."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 3 * SMALL))
        count = int(rng.integers(1, 5))
        keys = tuple(rng.integers(int(rng.integers(-60, 5)), int(rng.integers(5, 3000)), n) for _ in range(count))
        assert np.array_equal(lexsort_ints(keys), np.lexsort(keys))
    wide = (rng.integers(0, 2**40, 1500), rng.integers(0, 2**40, 1500))
    assert 2**40 * 2**40 > LIMIT and np.array_equal(lexsort_ints(wide), np.lexsort(wide))
    tied = (np.zeros(1500, dtype=np.int64), np.repeat(np.arange(5), 300)[::-1].copy())
    assert lexsort_ints(tied).tolist() == np.lexsort(tied).tolist()  # ties keep their places


def test_the_small_integer_order_is_the_stable_argsort():
    rng = np.random.default_rng(1)
    for bound in (1, 7, 300, RADIX, RADIX + 1, 2**40):
        values = rng.integers(0, bound, 5000)
        assert np.array_equal(stable_argsort_ints(values, bound), values.argsort(kind="stable"))
