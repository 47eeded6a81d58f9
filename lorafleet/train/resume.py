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
    """The step a resume starts from, checked: an intact checkpoint exists (a restart may find none yet)
    and ``--steps`` does not go below it. Broken newer checkpoints are reported."""
    from lorafleet.runtime.checkpoint_files import resumable_checkpoint

    checkpoints = options.run_dir.checkpoints
    found = resumable_checkpoint(checkpoints)
    if found is None:
        if restarted():
            return 0
        raise InputError(ARGS, "--resume", f"nothing to resume: no checkpoint in {checkpoints}")
    for line in found.broken if warn else ():
        print(f"lorafleet train: warning: checkpoint {line}; resuming from {found.step_dir.name}", file=sys.stderr)
    if options.steps < found.step:
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
    revisions: dict[str, list[Revision]] = {}
    if resumed_at is not None and out is not None:
        trained = trained_specs(Path(out), ledger.active if ledger is not None else None)
        if trained is not None:
            queued = ledger.queued() if ledger is not None else frozenset()
            revisions = resume_revisions(workload.spec.tasks, trained, resumed_at, path, allow_changes, queued)
    if ledger is not None:
        tasks = revised(ledger.active, workload.spec.tasks, revisions)
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
