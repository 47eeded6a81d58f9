"""From class totals d_ij to the sequences each replica holds.

Bucket by bucket, longest first, the bucket's sequences sorted by (task, length, position)
are dealt to classes, then to each class's replicas, in proportion to their shares and
interleaved (:func:`interleave`): every class and every replica gets a proportional,
spread-out slice of every task and of the bucket's length range (per-task fairness), and
a class's p replicas get floor(d/p) or ceil(d/p) sequences. The ceil shares go to the
replicas with the least load so far, so the slowest replica is usually below the
all-ceil load model that the balancers bound.
"""

from __future__ import annotations

import numpy as np

from lorafleet.dispatch.load import LoadModel
from lorafleet.dispatch.sorting import lexsort_ints, stable_argsort_ints

KEY_EXACT = 2.0**40
"""Shares s <= S of groups g < G sort by ``g + key`` exactly while S^2 G is below this: two keys of different
values differ by at least 1 / (2 S^2) (each is an odd integer over 2 s), far above the rounding of ``g + key``
(G 2^-53), and each ``g + key`` stays inside (g, g + 1) (keys lie in [1 / (2 S), 1 - 1 / (2 S)])."""


def interleave(shares: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """Owner of each of ``sum(shares)`` positions, owner k taking ``shares[k]`` of them spread evenly.

    Owner k's t-th item sits at key (t + 1/2) / shares[k]; sorting all keys (ties by owner)
    gives the order, so every prefix is split nearly in proportion (Sainte-Laguë order).
    With ``groups`` (each owner's group, the owners ordered by group), every group is interleaved
    apart, in one sort by (group, key, owner): the positions group by group, each group's in the
    order its own shares alone would give.

    The owners' items are laid out owner by owner, so a stable sort's ties are already by owner: one stable
    argsort of the keys, and with groups of ``group + key`` (keys lie in (0, 1)), which orders as (group, key)
    while the shares are small enough (:data:`KEY_EXACT`); past that, ``np.lexsort`` of the three.
    """
    shares = np.asarray(shares, dtype=np.int64)
    owners = np.repeat(np.arange(shares.size), shares)
    if owners.size == 0:
        return owners
    starts = np.repeat(np.cumsum(shares) - shares, shares)
    keys = (np.arange(owners.size) - starts + 0.5) / shares[owners]
    if groups is None:
        return owners[keys.argsort(kind="stable")]
    if float(shares.max()) ** 2 * (int(groups.max()) + 1) >= KEY_EXACT:
        return owners[np.lexsort((owners, keys, groups[owners]))]
    keys += groups[owners]
    return owners[keys.argsort(kind="stable")]


def replica_rows(load: LoadModel, i: int, totals: np.ndarray, p: int) -> np.ndarray:
    """(p, R) rows of each bucket on each of p replicas of class i holding class totals ``totals`` (R,).

    Bucket by bucket, longest first, every replica gets floor(d_j / p) rows and the d_j mod p
    extra ones go to the replicas with the least modelled load so far
    (:meth:`LoadModel.replica_load`; ties to the first): the rows :func:`place_sequences` deals.
    """
    if p == 1:
        return np.asarray(totals, dtype=np.int64).reshape(1, -1).copy()
    rows = np.zeros((p, load.boundaries.size), dtype=np.int64)
    totals = np.asarray(totals).tolist()
    for j in np.argsort(-load.boundaries, kind="stable").tolist():
        if not totals[j]:
            continue
        given = np.full(p, totals[j] // p)
        if totals[j] % p:  # the loads so far (this bucket's rows not in yet) are read only to give out extra ones
            given[np.argsort(load.replica_load(i, rows), kind="stable")[: totals[j] % p]] += 1
        rows[:, j] = given
    return rows


def placed_times(load: LoadModel, counts: np.ndarray) -> np.ndarray:
    """(K,) modelled time of each class's slowest replica once class totals ``counts`` (K, R) are placed.

    max_r T(n_r) over the class's replicas r with :func:`replica_rows`' n_r <= ceil(d_ij / p_i),
    so never above :meth:`LoadModel.times` when T grows with the rows. In padding mode it is the
    cost model's time of the padded micro-batches; in packing mode only the load model's
    estimate of the packed ones (the dispatcher and the planner price those:
    :func:`~lorafleet.dispatch.step.placed_work`).
    """
    return np.array(
        [
            load.replica_load(i, replica_rows(load, i, counts[i], len(c.replicas))).max()
            for i, c in enumerate(load.classes)
        ]
    )


def place_sequences(
    load: LoadModel,
    counts: np.ndarray,
    bucket: np.ndarray,
    lengths: np.ndarray,
    task_ids: np.ndarray,
    n_replicas_total: int,
) -> list[np.ndarray]:
    """Sequence positions held by each replica of the plan (in plan order), from class totals ``counts`` (K, R).

    Bucket by bucket (longest first), each sequence's class and then its replica in the class are dealt by
    :func:`interleave`: every bucket's deal to the classes in one grouped interleave (groups: the buckets), and
    every bucket's classes' deals to their replicas in another (groups: (bucket, class)), each group in the order
    its own deal would give. Then one stable sort by replica gives each replica its sequences in that order: the
    buckets it holds, longest first, each in dealing order."""
    rows = np.concatenate(
        [replica_rows(load, i, counts[i], len(c.replicas)) for i, c in enumerate(load.classes)]
    )  # (every class's replicas, R): one row a replica, the classes in order
    n_classes, n_slots = len(load.classes), rows.shape[0]
    slot_class = np.repeat(np.arange(n_classes), [len(c.replicas) for c in load.classes])
    slot_replica = np.array([r for c in load.classes for r in c.replicas], dtype=np.int64)
    order = lexsort_ints((np.arange(bucket.size), lengths, task_ids, bucket))
    starts = np.searchsorted(bucket[order], np.arange(load.boundaries.size + 1))
    dealt = np.argsort(-load.boundaries, kind="stable")
    dealt = dealt[starts[dealt + 1] > starts[dealt]]  # the buckets held, longest first
    if dealt.size == 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(n_replicas_total)]
    u = np.arange(dealt.size)
    to_class = interleave(counts[:, dealt].T.ravel(), np.repeat(u, n_classes))  # u K + class, position by position
    to_slot = interleave(rows[:, dealt].T.ravel(), (u[:, None] * n_classes + slot_class).ravel())  # u S + slot
    owner = np.empty(to_class.size, dtype=np.int64)
    # each (bucket, class)'s positions, in order, take its replicas in its own deal's order
    owner[stable_argsort_ints(to_class, dealt.size * n_classes)] = slot_replica[to_slot % n_slots]
    by_replica = stable_argsort_ints(owner, n_replicas_total)
    held = np.concatenate([order[starts[j] : starts[j + 1]] for j in dealt.tolist()])[by_replica]
    bounds = np.searchsorted(owner[by_replica], np.arange(n_replicas_total + 1)).tolist()
    return [held[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
