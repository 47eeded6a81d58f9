"""A change of the running fleet as a transaction: whatever process dies whenever, a restart finds the change either
not begun or recorded whole, and finishes it (docs/queue.md, *A change is a transaction*).

The files of a change, in the order rank 0 writes them (``train.changes``):

1. the boundary's checkpoint, committed, when a task leaves (the adapter it exports; a restart resumes there);
2. **begin**: ``<queue>/.apply.json`` (:func:`begin`): the requests, the running tasks' turns, the fleet before the
   change (``Pending.before``); only then are the request files moved to ``accepted/``;
3. **decide**: ``.apply.json`` again with the fleet after the change (:func:`decided`; ``Pending.after``, and
   ``handoff`` when the launcher applies it);
4. the leaving tasks' adapters exported from the checkpoint of step 1, the fleet changed in its processes, and a
   checkpoint started that records the change (its manifest's ``fleet_changed_at``);
5. **settle** (:func:`settle`), once that checkpoint has committed (an update of shares or deadlines alone settles at
   once: its turns carry their step): the ledger, ``plan.json`` and ``run.json`` written with the fleet after the
   change, ``.apply.json`` removed, the row appended to ``changes.jsonl``.

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

from lorafleet.train.change_log import ChangeRecord, append_change
from lorafleet.train.options import TrainOptions
from lorafleet.train.queue import FleetState, Ledger, Pending, Request, clear_pending, save_pending

if TYPE_CHECKING:
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
