"""``np.lexsort`` of integer keys by one stable argsort: what the dispatcher's per-step sorts of thousands of
sequences (by bucket, task, length, position) take, about half of lexsort's time on 2,000-15,000 keys."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LIMIT = 2**62
"""The combined key's range must stay below this (int64)."""
SMALL = 1024
"""Fewer keys than this are lexsorted: the combination's dozen calls cost more than lexsort there (~800 on this
machine, three keys; a service-64 replica's few dozen sequences)."""
RADIX = 2**15
"""Integers below this are sorted as int16, which numpy's stable sort orders by radix (~6x a 7,680-key timsort)."""


def stable_argsort_ints(values: np.ndarray, bound: int) -> np.ndarray:
    """``values.argsort(kind="stable")`` of integers in [0, ``bound``), by radix below :data:`RADIX` (a stable sort's
    order is the one order of its keys, whatever the algorithm)."""
    return (values.astype(np.int16) if bound <= RADIX else values).argsort(kind="stable")


def lexsort_ints(keys: Sequence[np.ndarray]) -> np.ndarray:
    """``np.lexsort(keys)`` (the last key primary, ties kept in place) of integer keys of one length, as the stable
    argsort of their mixed-radix combination

        c = Σ_i (k_i - min k_i) Π_{j < i} (max k_j - min k_j + 1)

    which is increasing in each key given the keys after it and equal only where every key is: the same order
    (:func:`stable_argsort_ints`: by radix where the product of the ranges is below :data:`RADIX`). Below
    :data:`SMALL` keys, or where the ranges' product reaches :data:`LIMIT`, ``np.lexsort`` itself."""
    if keys[0].size < SMALL:
        return np.lexsort(keys)
    combined, unit = np.zeros(keys[0].size, dtype=np.int64), 1
    for key in keys:
        low, high = int(key.min()), int(key.max())
        if unit * (high - low + 1) >= LIMIT:
            return np.lexsort(keys)
        combined += (key - low) * unit
        unit *= high - low + 1
    return stable_argsort_ints(combined, unit)
