"""Every process group a deployment plan needs, created up front in one deterministic order.

``torch.distributed.new_group`` is collective over the *whole* world: every rank must call
it for every group, members or not, in the same order. So each rank walks the same list:

1. the TP group of every stage of every replica (replica order, then stage order);
2. the gradient-sync group of every holder set (``grad_sync.holder_sets``, sorted).

A rank set that appears twice (a TP2 replica alone: its TP group is also the holder set of
its replicated factors) gets one group. Sets of one rank get none: there is nothing to
reduce. Pipeline neighbours need no group: point-to-point ops use global ranks.
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


def ordered_rank_sets(fleet: FleetLayout, holder_sets: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Every rank set that needs a group, de-duplicated, in creation order (see the module doc)."""
    ordered: dict[tuple[int, ...], None] = {}
    for replica in fleet.replicas:
        for stage in range(replica.pp):
            ranks = tuple(sorted(replica.stage_ranks(stage)))
            if len(ranks) > 1:
                ordered.setdefault(ranks)
    for ranks in holder_sets:
        if len(ranks) > 1:
            ordered.setdefault(tuple(sorted(ranks)))
    return list(ordered)


def build_process_groups(fleet: FleetLayout, holder_sets: Sequence[tuple[int, ...]], rank: int) -> ProcessGroups:
    """Creates every group on this rank (collective: all ranks must call it with the same arguments)."""
    created = {ranks: dist.new_group(list(ranks)) for ranks in ordered_rank_sets(fleet, holder_sets)}
    role = fleet.role(rank)
    tp = None
    if role is not None and role.replica.tp > 1:
        tp = created[tuple(sorted(role.replica.stage_ranks(role.stage)))]
    sync = {ranks: created[tuple(sorted(ranks))] for ranks in holder_sets if rank in ranks and len(ranks) > 1}
    return ProcessGroups(tp=tp, sync=sync)
