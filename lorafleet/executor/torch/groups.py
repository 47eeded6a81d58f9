"""Every process group a deployment plan needs, created up front in one deterministic order.

``torch.distributed.new_group`` is collective over the *whole* world: every rank must call
it for every group, members or not, in the same order. So each rank walks the same list:

1. the TP group of every stage of every replica (replica order, then stage order);
2. the gradient-sync group of every holder set (``grad_sync.holder_sets``, sorted);
3. one group of the whole world for the per-task updates' statistics (``updates``): the updates
   run on their own thread, which must not share a group with the main thread's messages.

A holder set with the ranks of a TP group (a TP2 replica alone: its TP group is also the
holder set of its replicated factors) still gets a group of its own (threads, above). Sets of
one rank get none: there is nothing to reduce. Pipeline neighbours need no group: point-to-point ops use global ranks.

**Reuse** (:class:`GroupCache`). A running fleet that changes its tasks or its deployment at a step
boundary (``change.py``) builds its groups again over the same world: every group whose purpose and
rank set it already has is reused, and only the new ones are created. Every rank made the same groups
in the same order before, so every rank's cache holds the same keys, skips the same ``new_group``
calls and makes the others in the same order: the creation stays collective and ordered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from lorafleet.runtime.layout import FleetLayout


class GroupCache:
    """Every group this rank has created, by purpose (``tp``, ``sync``, ``updates``) and rank set (module doc)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
        self.created = 0
        """Groups created through this cache (``new_group`` calls), for the tests' and benchmark's counts."""

    def get(self, purpose: str, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The group of ``ranks`` for ``purpose``, created when this cache has none (collective over the world:
        every rank asks for the same keys in the same order)."""
        key = (purpose, ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(ranks))
            self.created += 1
        return self._groups[key]


@dataclass(frozen=True)
class ProcessGroups:
    """The groups this rank belongs to."""

    tp: dist.ProcessGroup | None
    """This rank's stage TP group; None when tp = 1 (or the rank is idle)."""
    sync: dict[tuple[int, ...], dist.ProcessGroup]
    """Holder set -> group, for the sets that contain this rank."""
    updates: dist.ProcessGroup | None
    """Every rank, for the update thread's all-reduces only (None in a world of one)."""


def ordered_rank_sets(
    fleet: FleetLayout, holder_sets: Sequence[tuple[int, ...]]
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The TP sets and the holder sets that need a group, each de-duplicated, in creation order (see
    the module doc). A holder set equal to a TP set gets a group of its own: the gradient sums run on
    the update thread, the TP collectives on the main thread, and a gloo or NCCL group must not be
    used by two threads at once."""
    tp: dict[tuple[int, ...], None] = {}
    for replica in fleet.replicas:
        for stage in range(replica.pp):
            ranks = tuple(sorted(replica.stage_ranks(stage)))
            if len(ranks) > 1:
                tp.setdefault(ranks)
    sync = dict.fromkeys(tuple(sorted(ranks)) for ranks in holder_sets if len(ranks) > 1)
    return list(tp), list(sync)


def build_process_groups(
    fleet: FleetLayout, holder_sets: Sequence[tuple[int, ...]], rank: int, cache: GroupCache | None = None
) -> ProcessGroups:
    """Creates every group on this rank, or takes it from ``cache`` (collective: all ranks must call it with the
    same arguments, and caches that made the same groups)."""
    cache = cache if cache is not None else GroupCache()
    tp_sets, sync_sets = ordered_rank_sets(fleet, holder_sets)
    tp_groups = {ranks: cache.get("tp", ranks) for ranks in tp_sets}
    sync_groups = {ranks: cache.get("sync", ranks) for ranks in sync_sets}
    # A fleet of one rank has nothing to reduce (and may be built on one rank of a larger world:
    # the profiler's optimizer records), so it creates no group.
    updates = cache.get("updates", tuple(range(fleet.world_size))) if fleet.world_size > 1 else None
    role = fleet.role(rank)
    tp = None
    if role is not None and role.replica.tp > 1:
        tp = tp_groups[tuple(sorted(role.replica.stage_ranks(role.stage)))]
    sync = {ranks: sync_groups[tuple(sorted(ranks))] for ranks in holder_sets if rank in ranks and len(ranks) > 1}
    return ProcessGroups(tp=tp, sync=sync, updates=updates)
