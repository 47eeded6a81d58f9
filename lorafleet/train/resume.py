"""What a start of a run takes over from the run before it, read before anything is written: the step it
resumes from, the tasks it trains, and the plan it resumes by.

    resume_step(options)     None for a fresh start; on a resume (asked for, or torchrun's restart after a
                             failure: restarted()) the newest intact checkpoint's step, checked against
                             --steps, the broken newer ones named
    training_workload(...)   the workload with data for every task; with a task ledger (a run that took
                             queued changes) the ledger's tasks, and on a resume the file's tasks compared
                             with those the run trained (``train.revisions``: refused, or revised with
                             --allow-changes); load_training_workload is its workload alone
    resumed_plan(...)        --plan, or the run's own plan.json when queued changes changed its tasks since
    ledger_turns(...)        the ledger's turn changes and departed tasks' turns, which the data cursors follow

``train.preflight.prepare`` asks these on the launcher (and a user's torchrun's ranks); a rank asks
``resume_step`` and ``ledger_turns`` again when it reads the run file (``train.run_file``: a restart finds a
newer checkpoint). No torch import here: the checkpoint helpers it reads (``runtime.checkpoint_files``) are
torch-free.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.errors import InputError
from lorafleet.train.options import ARGS, TrainOptions
from lorafleet.workload import Workload

if TYPE_CHECKING:
    from lorafleet.train.queue.pending import FleetState, Pending
    from lorafleet.train.revisions import Revision

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of this worker's restarts after failures (0, or unset, on its first start)."""


def restarted() -> bool:
    """Whether torchrun restarted this worker after a failure (then it resumes, asked or not)."""
    return int(os.environ.get(RESTART_ENV, "0") or 0) > 0


def resume_step(options: TrainOptions, warn: bool | None = None) -> int | None:
    """The step this start of the run resumes from: None for a fresh start, else the newest intact checkpoint's
    (a resume asked for, or a restart after a failure; :func:`_resume_step` checks it). ``warn``: whether to
    name the broken checkpoints passed over; by default in the launcher and in rank 0 of a user's torchrun,
    so that a run says it once."""
    if warn is None:
        warn = os.environ.get("RANK", "0") == "0"
    return _resume_step(options, warn) if options.resume or restarted() else None


def _resume_step(options: TrainOptions, warn: bool) -> int | None:
    """The step a resume starts from, checked: an intact checkpoint exists, or the run started (its run file) and
    none has committed yet (then 0, as a restart), and ``--steps`` does not go below it. Broken newer checkpoints
    are reported."""
    from lorafleet.runtime.checkpoint_files import resumable_checkpoint

    checkpoints = options.run_dir.checkpoints
    found = resumable_checkpoint(checkpoints)
    if found is None:
        if restarted() or options.run_dir.run_file.is_file():  # a run killed before its first checkpoint committed
            return 0  # starts again from step 0 with what it recorded: its queue, its ledger, a change in flight
        raise InputError(ARGS, "--resume", f"nothing to resume: no checkpoint in {checkpoints}")
    for line in found.broken if warn else ():
        print(f"lorafleet train: warning: checkpoint {line}; resuming from {found.step_dir.name}", file=sys.stderr)
    if options.steps is not None and options.steps < found.step:  # None: until the tasks are done
        raise InputError(
            ARGS,
            "--steps",
            f"{options.steps} is below the {found.step} steps the run has committed; "
            "--steps is the run's total and a resume never rolls back",
        )
    return found.step


def load_training_workload(path: str, out: str | None = None, sets: tuple[str, ...] = ()) -> Workload:
    """The workload, with data for every task (planning needs only lengths; training needs rows), its
    ``--set`` overrides ``sets`` applied. With a run directory ``out`` whose task ledger exists (a run that
    took queued changes), its active tasks replace the file's (``train.queue``)."""
    return training_workload(path, out, sets)[0]


def training_workload(
    path: str, out: str | None, sets: tuple[str, ...], resumed_at: int | None = None, allow_changes: bool = False
) -> tuple[Workload, dict[str, list[Revision]]]:
    """:func:`load_training_workload`, and on a resume at step ``resumed_at`` the file's tasks compared with
    those the run trained by (``train.revisions``): refused when changed, unless ``allow_changes``; then the
    changed fields are the file's, and the revisions are returned by task."""
    from lorafleet.train.queue import Ledger
    from lorafleet.train.revisions import resume_revisions, revised, trained_specs
    from lorafleet.workload import load_workload, resolve_workload

    workload = load_workload(path, sets)
    ledger = Ledger.load(out) if out is not None else None
    if resumed_at is not None and ledger is not None and not ledger.active:
        from lorafleet.rundir import RunDir

        last = max((e.left for e in ledger.entries if e.left is not None), default=resumed_at)
        raise InputError(
            ARGS,
            "--resume",
            f"every task of this run has left it (finished or cancelled, the last at step {last}): nothing to "
            f"resume; start a new run (the adapters are in {RunDir(out).adapters})",
        )
    revisions: dict[str, list[Revision]] = {}
    if resumed_at is not None and out is not None:
        trained = trained_specs(Path(out), ledger.active if ledger is not None else None)
        if trained is not None:
            queued = ledger.queued() if ledger is not None else frozenset()
            revisions = resume_revisions(workload.spec.tasks, trained, resumed_at, path, allow_changes, queued)
    if ledger is not None:
        new = [t.name for t in workload.spec.tasks if t.name not in ledger.names()]
        if new:
            raise InputError(
                path,
                "tasks",
                f"{', '.join(new)} is not in the run being resumed: its tasks are its task ledger's "
                f"({Path(out or '.') / 'tasks.json'}); add a task to a running job through its queue (a request file "
                "in --queue, or POST /v1/tasks: docs/queue.md), which starts it at the step it asks for",
            )
        tasks = tuple(revised(ledger.active, workload.spec.tasks, revisions))
        workload = resolve_workload(workload.spec.model_copy(update={"tasks": tasks}), path)
    missing = [t.name for t in workload.tasks if t.spec.data is None]
    if missing:
        raise InputError(path, "tasks", f"training needs data for every task; {', '.join(missing)} has none")
    return workload, revisions


def resumed_plan(options: TrainOptions, workload: Workload) -> str:
    """The plan a resume trains by: ``--plan``, unless the run's queue changed its tasks since (``workload``
    holds the ledger's) and the run's own plan (``<out>/plan.json``, what it last trained by) is for them:
    the command that started the run resumes it as it is."""
    from lorafleet.plans import DeploymentPlan

    names = tuple(t.name for t in workload.tasks)
    own = options.run_dir.plan
    if DeploymentPlan.load(options.plan).tasks == names or not own.is_file():
        return options.plan
    return str(own) if DeploymentPlan.load(own).tasks == names else options.plan


def ledger_turns(options: TrainOptions, start: int | None) -> tuple[dict[str, tuple], tuple]:
    """The task ledger's turn changes and departed tasks' turns (``train.queue``), when resuming from ``start``
    (a fresh start has none)."""
    from lorafleet.train.queue import Ledger

    ledger = Ledger.load(options.out) if start is not None else None
    return (ledger.turn_changes(), ledger.departed()) if ledger is not None else ({}, ())


def change_in_flight(options: TrainOptions, start: int | None) -> tuple[Pending | None, bool]:
    """A change of the running fleet in flight that rank 0 finishes (``<queue>/.apply.json`` the workers wrote, not
    one for the launcher: ``train.queue.pending``, ``train.inflight``), and whether the checkpoint of step ``start``
    (None: none) was taken after it (its manifest's ``fleet_changed_at`` is the change's step or later): then only
    settling the change is left; else it is done again at its step, on the fleet as it was before it.
    ``(None, False)`` without one. InputError when the record is stale: its step is before the checkpoint the run
    resumes from, which was not taken after it (a file left by hand, or of another run)."""
    from lorafleet.runtime.checkpoint_files import fleet_changed_at, step_dir_name
    from lorafleet.train.queue import load_pending

    pending = load_pending(options.queue_dir)
    if pending is None or pending.for_launcher:
        return None, False
    step_dir = options.run_dir.checkpoints / step_dir_name(start or 0)
    changed = fleet_changed_at(step_dir) if start and step_dir.is_dir() else None
    after = changed is not None and changed >= pending.step and pending.after is not None
    if pending.step < (start or 0) and not after:
        raise InputError(
            str(options.run_dir.pending),
            "step",
            f"a change at step {pending.step}, but the run resumes from the checkpoint of step {start}, taken before "
            "it was applied; remove this file to drop the change, or restore the checkpoints it was made with",
        )
    _check_requests(options, pending)
    return pending, after


def _check_requests(options: TrainOptions, pending: Pending) -> None:
    """InputError when a request of a change in flight cannot apply to the run's tasks (a file edited by hand: an
    unknown task, a second add of a name), each judged as the watcher judged it, after those before it; one the
    ledger has taken already (a crash while the change settled) is not judged again."""
    from lorafleet.specs.workload import WorkloadSpec
    from lorafleet.train.queue import Ledger, RequestError
    from lorafleet.train.queue.watcher import check_against

    assert pending.before is not None
    ledger = Ledger.load(options.out) or Ledger.of(WorkloadSpec.model_validate(pending.before.workload).tasks)
    done = {(a["step"], a["file"], a["action"], a["name"]) for a in ledger.applied}
    for k, request in enumerate(pending.requests):
        if (pending.step, request.file, request.action, request.name) in done:
            continue
        try:
            check_against(request, ledger)
        except RequestError as err:
            raise InputError(
                str(options.run_dir.pending), f"requests[{k}]", f"{err}; remove this file to drop the change"
            ) from None
        ledger = ledger.apply([request], pending.step)


def in_flight(options: TrainOptions, start: int | None) -> FleetState | None:
    """While a change of the running fleet is in flight (:func:`change_in_flight`), the fleet a start from the
    checkpoint of step ``start`` builds: the fleet after the change when that checkpoint was taken after it, else
    the fleet before it, on which rank 0 applies the change again at its step. None when none is in flight."""
    pending, after = change_in_flight(options, start)
    if pending is None:
        return None
    state = pending.after if after else pending.before
    assert state is not None
    return state
