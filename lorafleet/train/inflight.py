"""A change of the running fleet as a transaction: whatever process dies whenever, a restart finds the change either
not begun or recorded whole, and finishes it (docs/queue.md, *A change is a transaction*).

The files of a change, in the order rank 0 writes them (``train.changes``):

1. the boundary's checkpoint, committed, when a task leaves (the adapter it exports; a restart resumes there);
2. **begin**: ``<queue>/.apply.json`` (:func:`begin`): the requests, the running tasks' turns, the fleet before the
   change (``Pending.before``); only then are the request files moved to ``accepted/``;
3. **decide**: ``.apply.json`` again with the fleet after the change (:func:`decided`; ``Pending.after``, and
   ``handoff`` when the launcher applies it);
4. the leaving tasks' adapters exported from the checkpoint of step 1, the fleet changed in its processes (and a
   join's checkpoint started); every checkpoint from here on records the change (its manifest's
   ``fleet_changed_at``);
5. **settle** (:func:`settle`), once a checkpoint taken after the change has committed (:class:`InFlight`; an
   update of shares or deadlines alone settles at once: its turns carry their step): the ledger, ``plan.json`` and
   ``run.json`` written with the fleet after the change, ``.apply.json`` removed, the row appended to
   ``changes.jsonl``.

Invariants: while ``.apply.json`` exists, the ledger, ``plan.json`` and ``run.json`` may say the fleet before the
change or after it, and nothing reads them for the fleet: a start reads ``.apply.json`` instead and builds the fleet
on the side of the change its checkpoint is on (``resume.in_flight``). Before it exists, nothing of the change is
written (its request files are still in the queue). Once it is gone, all of the change is written, and the newest
checkpoint was taken after it. Every step of the change can be done again with the same result (the ledger takes a
request once; an export replaces the directory; the files are written whole), so a change found in flight is done
again from its record at its step (``resume.change_in_flight`` finds it), with the decision recorded, never decided
anew.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lorafleet.planner.decision import Keep, Move
from lorafleet.train.change_log import ChangeRecord, append_change
from lorafleet.train.options import TrainOptions
from lorafleet.train.queue import FleetState, Ledger, Pending, Request, clear_pending, save_pending

if TYPE_CHECKING:
    from lorafleet.plans import DeploymentPlan
    from lorafleet.train.running import FleetPort
    from lorafleet.turns import TaskTurns


@dataclass(frozen=True)
class Settling:
    """A change applied in the fleet's processes, waiting for a checkpoint taken after it to commit."""

    pending: Pending
    ledger: Ledger
    """The ledger with the change's requests applied."""
    row: ChangeRecord


def begin(
    options: TrainOptions, step: int, requests: Sequence[Request], turns: Mapping[str, TaskTurns], before: FleetState
) -> Pending:
    """Step 2 of the module doc: the change recorded before anything of it is written."""
    pending = Pending(step, list(requests), dict(turns), before=before)
    save_pending(options.queue_dir, pending)
    return pending


def decided(
    options: TrainOptions, pending: Pending, after: FleetState, handoff: bool = False, replan_at: int | None = None
) -> Pending:
    """Step 3 of the module doc: the fleet after the change recorded (``handoff``: the launcher applies it;
    ``replan_at``: the boundary the re-plan the change starts beside the steps answers at)."""
    pending = replace(pending, after=after, handoff=handoff, replan_at=replan_at)
    save_pending(options.queue_dir, pending)
    return pending


def to_launcher(options: TrainOptions, pending: Pending) -> Pending:
    """The change recorded for the launcher to decide and apply (``LORAFLEET_RELAUNCH_CHANGES``)."""
    pending = replace(pending, handoff=True)
    save_pending(options.queue_dir, pending)
    return pending


def settle(options: TrainOptions, settling: Settling) -> None:
    """Step 5 of the module doc: the change's files written with the fleet after it, then its record removed."""
    from lorafleet.train.run_file import ResolvedRun

    after = settling.pending.after
    assert after is not None
    run_dir = options.run_dir
    settling.ledger.save(options.out)
    after.plan.save(run_dir.plan)
    if run_dir.run_file.is_file():
        replace(ResolvedRun.load(run_dir.run_file), state=after).save(run_dir)
    clear_pending(options.queue_dir)
    append_change(run_dir.changes, settling.row)


class InFlight:
    """This process's change in flight: the one applied and waiting to settle, or the one a start found and does
    again at its step; and the step of the last change applied (what a checkpoint records of it)."""

    def __init__(self, options: TrainOptions, fleet: FleetPort) -> None:
        self.options, self.fleet = options, fleet
        self.settling: Settling | None = None
        """The last change, applied, until a checkpoint taken after it commits."""
        self.redo: Pending | None = None
        """A change found in flight at the start, done again at its step."""
        self.changed_at: int | None = None
        """The step of the last change applied in the fleet's processes."""

    def checkpoint_extra(self) -> dict[str, int]:
        """What a checkpoint records of the changes: the last one applied before it (``fleet_changed_at``)."""
        from lorafleet.runtime.checkpoint_files import FLEET_CHANGED_AT

        return {FLEET_CHANGED_AT: self.changed_at} if self.changed_at is not None else {}

    def take_redo(self, step: int) -> Pending | None:
        """The change found in flight when it is due at the boundary before ``step``, no longer waiting."""
        if self.redo is None or self.redo.step != step:
            return None
        redo, self.redo = self.redo, None
        return redo

    def applied(self, settling: Settling, now: bool) -> None:
        """Step 4's end (module doc): the change applied in the fleet's processes settles once a checkpoint taken
        after it commits (the next one: a join's, started at once, a periodic one, the run's last, a stop's, or the
        one the next change takes first: :meth:`settle_before`), or at once with ``now`` (an update of shares or
        deadlines alone: its turns carry their step, so a restart from before it replays the steps before it as
        they were)."""
        self.changed_at = settling.pending.step
        if now:
            settle(self.options, settling)
        else:
            self.settling = settling

    def settle_committed(self, wait: bool = False) -> None:
        """The change waiting to settle settled once a checkpoint taken after it has committed (``wait``: the one
        being written waited for first)."""
        from lorafleet.runtime.processes import fault_point

        if self.settling is None:
            return
        if wait:
            self.fleet.flush()
        changed = self.fleet.committed_change()
        if changed is not None and changed >= self.settling.pending.step:
            settling, self.settling = self.settling, None
            fault_point("settling", settling.pending.step)
            settle(self.options, settling)

    def settle_before(self, step: int) -> None:
        """One change in flight at a time: the one waiting to settle is settled before another begins at the boundary
        before ``step``, on a checkpoint of that boundary taken (and waited for) when none after it has committed."""
        if self.settling is None:
            return
        self.settle_committed(wait=True)
        if self.settling is not None:
            self.fleet.checkpoint(step, wait=True)
            self.settle_committed()
        assert self.settling is None, "a checkpoint taken after the change committed"

    def recovered(self, pending: Pending, after: bool, ledger: Ledger, row: ChangeRecord) -> None:
        """A change a start found in flight (``resume.change_in_flight``): settled now when the checkpoint resumed from
        was taken after it (``after``; ``ledger`` and ``row``: what it settles with), else done again at its step."""
        if after:
            settle(self.options, Settling(pending, ledger, row))
            self.changed_at = pending.step
        else:
            self.redo = pending


def recorded_decision(pending: Pending, running: DeploymentPlan) -> Keep | Move:
    """The decision a change in flight recorded (``Pending.after``), taken again as it was: a re-plan is never
    made anew for a change done again after a restart (its answer could differ: the price of a move is learnt)."""
    assert pending.after is not None
    plan = pending.after.plan
    if pending.replan_at is not None or plan.placements == running.placements:
        return Keep(plan, pending.replan_at)
    return Move(plan)
