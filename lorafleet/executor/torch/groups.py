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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from lorafleet.executor.torch.layout import FleetLayout


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


def build_process_groups(fleet: FleetLayout, holder_sets: Sequence[tuple[int, ...]], rank: int) -> ProcessGroups:
    """Creates every group on this rank (collective: all ranks must call it with the same arguments)."""
    tp_sets, sync_sets = ordered_rank_sets(fleet, holder_sets)
    tp_groups = {ranks: dist.new_group(list(ranks)) for ranks in tp_sets}
    sync_groups = {ranks: dist.new_group(list(ranks)) for ranks in sync_sets}
    # A fleet of one rank has nothing to reduce (and may be built on one rank of a larger world:
    # the profiler's optimizer records), so it creates no group.
    updates = dist.new_group(list(range(fleet.world_size))) if fleet.world_size > 1 else None
    role = fleet.role(rank)
    tp = None
    if role is not None and role.replica.tp > 1:
        tp = tp_groups[tuple(sorted(role.replica.stage_ranks(role.stage)))]
    sync = {ranks: sync_groups[tuple(sorted(ranks))] for ranks in holder_sets if rank in ranks and len(ranks) > 1}
    return ProcessGroups(tp=tp, sync=sync, updates=updates)
