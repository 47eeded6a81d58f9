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
from lorafleet.dispatch.sorting import lexsort_ints


def interleave(shares: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """Owner of each of ``sum(shares)`` positions, owner k taking ``shares[k]`` of them spread evenly.

    Owner k's t-th item sits at key (t + 1/2) / shares[k]; sorting all keys (ties by owner)
    gives the order, so every prefix is split nearly in proportion (Sainte-Laguë order).
    With ``groups`` (each owner's group, the owners ordered by group), every group is interleaved
    apart, in one sort by (group, key, owner): the positions group by group, each group's in the
    order its own shares alone would give.
    """
    shares = np.asarray(shares, dtype=np.int64)
    owners = np.repeat(np.arange(shares.size), shares)
    if owners.size == 0:
        return owners
    starts = np.repeat(np.cumsum(shares) - shares, shares)
    keys = (np.arange(owners.size) - starts + 0.5) / shares[owners]
    return owners[np.lexsort((owners, keys) if groups is None else (owners, keys, groups[owners]))]


def replica_rows(load: LoadModel, i: int, totals: np.ndarray, p: int) -> np.ndarray:
    """(p, R) rows of each bucket on each of p replicas of class i holding class totals ``totals`` (R,).

    Bucket by bucket, longest first, every replica gets floor(d_j / p) rows and the d_j mod p
    extra ones go to the replicas with the least modelled load so far
    (:meth:`LoadModel.replica_load`; ties to the first): the rows :func:`place_sequences` deals.
    """
    if p == 1:
        return np.asarray(totals, dtype=np.int64).reshape(1, -1).copy()
    rows = np.zeros((p, load.boundaries.size), dtype=np.int64)
    for j in np.argsort(-load.boundaries, kind="stable"):
        if totals[j] == 0:
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
    :func:`interleave`, every class's deal of a bucket in one sort (its ``groups``). Then one stable sort by
    replica gives each replica its sequences in that order: the buckets it holds, longest first, each in dealing
    order."""
    rows = np.concatenate(
        [replica_rows(load, i, counts[i], len(c.replicas)) for i, c in enumerate(load.classes)]
    )  # (every class's replicas, R): one row a replica, the classes in order
    slot_class = np.repeat(np.arange(len(load.classes)), [len(c.replicas) for c in load.classes])
    slot_replica = np.array([r for c in load.classes for r in c.replicas], dtype=np.int64)
    order = lexsort_ints((np.arange(bucket.size), lengths, task_ids, bucket))
    starts = np.searchsorted(bucket[order], np.arange(load.boundaries.size + 1))
    dealt, owners = [], []
    for j in np.argsort(-load.boundaries, kind="stable"):
        members = order[starts[j] : starts[j + 1]]
        if members.size == 0:
            continue
        owner = np.empty(members.size, dtype=np.int64)
        # the class's sequences, in dealing order, take its replicas in its own deal's order
        owner[np.argsort(interleave(counts[:, j]), kind="stable")] = slot_replica[interleave(rows[:, j], slot_class)]
        dealt.append(members)
        owners.append(owner)
    if not dealt:
        return [np.zeros(0, dtype=np.int64) for _ in range(n_replicas_total)]
    owner = np.concatenate(owners)
    by_replica = np.argsort(owner, kind="stable")
    held = np.concatenate(dealt)[by_replica]
    bounds = np.searchsorted(owner[by_replica], np.arange(n_replicas_total + 1)).tolist()
    return [held[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
