"""The pending changes, ``<queue>/.apply.json``: a change of the running fleet from the moment its requests are due
until it is settled. It is the change's write-ahead record: what the change is, the fleet before it and, once
decided, the fleet after it, so that a process that dies anywhere in between leaves a change that is either not
begun or finished by whoever starts next (docs/queue.md, *A change is a transaction*).

Rank 0 writes it when requests are due, before anything else of the change is written (after the boundary's
checkpoint when a task leaves), and again once the change is decided (:attr:`Pending.after`); it removes it when the
change is settled: the fleet changed in its processes, a checkpoint taken after the change committed, and the
ledger, the run's plan and its run file written (``train.changes``). A change the running processes cannot apply
(:attr:`Pending.handoff`: the new plan needs more of them) the launcher applies between two launches
(``train.live.apply_pending``). Its name starts with ``.``, so the watcher never reads it as a request. The file
is typed (:data:`PENDING_FILE`: unknown keys refused, a wrong value named by its field path); ``lorafleet schema
pending`` prints its JSON Schema.

**A re-plan under way**, ``<queue>/.replan.json`` (:class:`PendingReplan`). A change the running deployment
can serve is applied on it at once, and the incremental re-plan runs beside the next steps
(``train.background``); the move it finds, if any, is applied a fixed number of steps later. The file says so
from the change's boundary until that step's boundary, so a resume in between runs the re-plan again and
applies its answer at the same step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from lorafleet.plans import DeploymentPlan
from lorafleet.rundir import PENDING, PENDING_REPLAN
from lorafleet.specs._base import Bool, Int
from lorafleet.specs.field_docs import documented
from lorafleet.specs.io import read_json_as, write_json_as
from lorafleet.train.queue.ledger import Change, Ledger
from lorafleet.train.queue.requests import Request
from lorafleet.turns import TaskTurns

if TYPE_CHECKING:
    from lorafleet.workload import Workload


@dataclass(frozen=True)
class FleetState:
    """The fleet a run trains from a step on, whole: the plan, the tasks (their lengths resolved) and the turns of
    the tasks whose share changed or that left. What a rank builds its part of the fleet from (the run file,
    ``train.run_file``), and what a change in flight records of the fleet before and after it (:class:`Pending`)."""

    __pydantic_config__ = documented(extra="forbid")

    deployment: dict[str, Any]
    """The plan file's object (``DeploymentPlan.to_json``: a plan keeps its own versioned format here too): the
    deployment, its dispatch policy as the launcher checked it (the one policy the ranks run); :attr:`plan`."""
    workload: dict[str, Any]
    """The validated workload spec as JSON: ``--set`` applied, the ledger's tasks, every path absolute."""
    lengths: dict[str, tuple[tuple[Int, Int], ...]] = field(default_factory=dict)
    """``(token length, rows)`` pairs of each task whose lengths read a dataset (``workload.reads_dataset``), by
    task: the fleet is resolved without tokenizing any data for its lengths."""
    turn_changes: dict[str, tuple[Change, ...]] = field(default_factory=dict)
    """Tasks whose share or deadline a queued update changed, with their history (``Ledger.turn_changes``)."""
    departed: tuple[TaskTurns, ...] = ()
    """The turns of the tasks that left the run (``Ledger.departed``)."""

    @classmethod
    def of(
        cls,
        plan: DeploymentPlan,
        workload: Workload,
        turn_changes: Mapping[str, tuple[Change, ...]] | None = None,
        departed: tuple[TaskTurns, ...] = (),
    ) -> FleetState:
        """``plan`` running ``workload``'s tasks, with their turns' history (a ledger's: :meth:`of_ledger`)."""
        lengths = {t.name: tuple(t.histogram.items()) for t in workload.tasks if t.histogram is not None}
        spec = workload.spec.model_dump(mode="json", exclude_none=True)
        changes = dict(turn_changes or {})
        return cls(deployment=plan.to_json(), workload=spec, lengths=lengths, turn_changes=changes, departed=departed)

    @functools.cached_property
    def plan(self) -> DeploymentPlan:
        """The deployment (:attr:`deployment`, read as a plan file is)."""
        return DeploymentPlan.from_json(self.deployment, "<the fleet's state>", "deployment")

    @classmethod
    def of_ledger(cls, plan: DeploymentPlan, workload: Workload, ledger: Ledger) -> FleetState:
        return cls.of(plan, workload, ledger.turn_changes(), ledger.departed())

    def resolved(self, path: str) -> Workload:
        """The workload (``path``: what errors name), its tasks' lengths taken as recorded, not tokenized again."""
        from lorafleet.specs.workload import WorkloadSpec
        from lorafleet.workload import resolve_workload

        known = {name: dict(pairs) for name, pairs in self.lengths.items()}
        return resolve_workload(WorkloadSpec.model_validate(self.workload), path, known)


@dataclass(frozen=True)
class Pending:
    """A change in flight (module doc): the requests due at a boundary, the running tasks' turns, and the fleet
    before and (once decided) after it."""

    __pydantic_config__ = documented(extra="forbid")

    step: Int
    """The boundary: the first step with the change."""
    requests: list[Request]
    """The requests due there, in the order the watcher took them (none: a re-plan's move)."""
    turns: dict[str, TaskTurns] = field(default_factory=dict)
    """The running tasks' turns, by name (the ledger keeps those of the tasks that leave)."""
    before: FleetState | None = None
    """The fleet before the change: what a process that restarts from a checkpoint taken before it builds, to apply
    the change again at its step. None: a file whose change the launcher applies (below)."""
    after: FleetState | None = None
    """The fleet after the change, once decided: what a process that restarts from a checkpoint taken after it
    builds, and what settling it writes."""
    replan_at: Int | None = None
    """The boundary the re-plan the change starts beside the steps answers at (``planner.decision.Keep``), recorded
    with the decision: a change done again starts it again."""
    handoff: Bool = False
    """The change needs processes the running ones are not (its plan has more ranks), or was sent to the launcher:
    the launcher applies it between two launches (``train.live.apply_pending``), as it applies a file without
    :attr:`before` (one of an older lorafleet)."""

    @property
    def for_launcher(self) -> bool:
        """Whether the launcher applies it (:attr:`handoff`, or nothing recorded of the fleet before it)."""
        return self.handoff or self.before is None


PENDING_FILE = TypeAdapter(Pending)


@dataclass(frozen=True)
class PendingReplan:
    """An incremental re-plan running beside the steps: for the tasks of boundary ``step``, applied at ``at``."""

    __pydantic_config__ = documented(extra="forbid")

    step: Int
    """The boundary of the change it re-plans for."""
    at: Int
    """The boundary its answer is applied at (``--replan-after`` steps after ``step``)."""


REPLAN_FILE = TypeAdapter(PendingReplan)


def save_pending(directory: str | Path, pending: Pending) -> None:
    """The requests accepted at the boundary before ``pending.step``, until they are applied."""
    write_json_as(Path(directory) / PENDING, PENDING_FILE, pending)


def load_pending(directory: str | Path) -> Pending | None:
    """The pending changes in the queue ``directory``; None when there are none; InputError when the file is
    not one."""
    path = Path(directory) / PENDING
    if not path.is_file():
        return None
    return read_json_as(path, PENDING_FILE, "pending-changes file")


def has_pending(directory: str | Path) -> bool:
    return (Path(directory) / PENDING).is_file()


def launcher_pending(directory: str | Path) -> Pending | None:
    """The pending change of the queue ``directory`` when the launcher is the one to apply it
    (:attr:`Pending.for_launcher`), else None."""
    pending = load_pending(directory)
    return pending if pending is not None and pending.for_launcher else None


def clear_pending(directory: str | Path) -> None:
    (Path(directory) / PENDING).unlink(missing_ok=True)


def save_pending_replan(directory: str | Path, pending: PendingReplan) -> None:
    write_json_as(Path(directory) / PENDING_REPLAN, REPLAN_FILE, pending)


def load_pending_replan(directory: str | Path) -> PendingReplan | None:
    """The re-plan under way in the queue ``directory``; None when there is none; InputError when the file is
    not one."""
    path = Path(directory) / PENDING_REPLAN
    return read_json_as(path, REPLAN_FILE, "pending re-plan file") if path.is_file() else None


def clear_pending_replan(directory: str | Path) -> None:
    (Path(directory) / PENDING_REPLAN).unlink(missing_ok=True)
