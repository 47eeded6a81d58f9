"""The run's task ledger, ``<out>/tasks.json``: every task the run has had, and the requests applied.

Each task is there in the order it joined, with its spec (data paths absolute, ``start_step`` the step
it joined at), its state (:class:`TaskState`) and the step it left at; then every request applied, by
step. A resume trains the ledger's active tasks. The file is typed (:class:`LedgerFile`: unknown keys
refused, a wrong value named by its field path); ``lorafleet schema ledger`` prints its JSON Schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, PlainSerializer, TypeAdapter, with_config
from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing only on Python >= 3.12

from lorafleet.rundir import LEDGER
from lorafleet.specs._base import Float, Int
from lorafleet.specs.field_docs import documented
from lorafleet.specs.io import read_json_as, write_json_as
from lorafleet.specs.workload import TaskSpec
from lorafleet.train.queue.requests import Action, Request, updated_task
from lorafleet.train.revisions import Revision, describe
from lorafleet.turns import TaskTurns


class TaskState(StrEnum):
    """Where a task of the ledger stands."""

    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"


Change = tuple[Int, Float | None, Int | None]
"""``(step, share, deadline)``: from that step on (``turns.TaskTurns.changes``)."""

LedgerSpec = Annotated[TaskSpec, PlainSerializer(lambda spec: spec.model_dump(mode="json", exclude_none=True))]
"""A task's spec in the ledger: written without its unset (None) fields."""


@dataclass(frozen=True)
class LedgerEntry:
    """One task the run has had."""

    __pydantic_config__ = documented(extra="forbid")

    spec: LedgerSpec
    state: TaskState = TaskState.ACTIVE
    left: Int | None = None
    """The step it left the run at (finished or cancelled)."""
    changes: tuple[Change, ...] = ()
    """Its share and deadline over time, from its start, once an update changed them (else empty)."""
    turns: TaskTurns | None = None
    """Its turns as the run drew them when it left (``lorafleet.turns``; the streams of the tasks that stay
    redraw the steps before it left with it)."""
    revisions: tuple[Revision, ...] = ()
    """Its hyperparameters changed on resumes (``--allow-changes``; ``train.revisions``), in order."""


@with_config(documented(extra="forbid"))
class AppliedRequest(TypedDict):
    """A request the ledger took, at the boundary before ``step``."""

    step: Int
    file: str
    """The request file (its name in the queue directory), or how the change came (a task that took its steps)."""
    action: Action
    name: str
    """The task."""


class LedgerFile(BaseModel):
    """``tasks.json`` as written: the ledger's entries (``tasks``) and the requests applied, in order."""

    model_config = documented(extra="forbid")

    tasks: tuple[LedgerEntry, ...]
    """Every task the run has had, in the order it joined."""
    applied: tuple[AppliedRequest, ...] = ()
    """Every request applied, in order."""


LEDGER_FILE = TypeAdapter(LedgerFile)


@dataclass(frozen=True)
class Ledger:
    """Every task the run has had (module doc)."""

    entries: tuple[LedgerEntry, ...]
    applied: tuple[AppliedRequest, ...] = ()
    """Every request applied, in order."""

    @classmethod
    def of(cls, tasks: Sequence[TaskSpec]) -> Ledger:
        return cls(tuple(LedgerEntry(t) for t in tasks))

    @property
    def active(self) -> tuple[TaskSpec, ...]:
        return tuple(e.spec for e in self.entries if e.state is TaskState.ACTIVE)

    def names(self) -> set[str]:
        return {e.spec.name for e in self.entries}

    def turn_changes(self) -> dict[str, tuple[Change, ...]]:
        """Active tasks whose share or deadline changed while the run went on: their history."""
        return {e.spec.name: e.changes for e in self.entries if e.state is TaskState.ACTIVE and e.changes}

    def departed(self) -> tuple[TaskTurns, ...]:
        """The turns of the tasks that left (in the order they were added)."""
        return tuple(e.turns for e in self.entries if e.state is not TaskState.ACTIVE and e.turns is not None)

    def apply(self, requests: Sequence[Request], step: int, turns: Mapping[str, TaskTurns] | None = None) -> Ledger:
        """The ledger after ``requests``, applied at the boundary before ``step``; ``turns``: the running tasks'
        (kept for those that leave). A request the ledger has applied at that step already (the same file,
        action and task) is skipped: applying a boundary's pending changes again (after a crash between the
        ledger's write and the pending file's removal) records each change once."""
        done = {(a["step"], a["file"], a["action"], a["name"]) for a in self.applied}
        requests = [r for r in requests if (step, r.file, r.action, r.name) not in done]
        entries = list(self.entries)
        index = {e.spec.name: k for k, e in enumerate(entries)}
        for r in requests:
            if r.action is Action.ADD:
                assert r.task is not None
                index[r.name] = len(entries)
                entries.append(LedgerEntry(r.task.model_copy(update={"start_step": step})))
                continue
            k = index[r.name]
            if r.action is Action.UPDATE:
                e = entries[k]
                spec = updated_task(e.spec, r.changes)
                history = e.changes or ((e.spec.start_step, e.spec.share, e.spec.deadline),)
                entries[k] = replace(e, spec=spec, changes=(*history, (step, spec.share, spec.deadline)))
            else:
                state = TaskState.FINISHED if r.action is Action.FINISH else TaskState.CANCELLED
                turn = (turns or {}).get(r.name)
                until = step if turn is None or turn.until is None else min(step, turn.until)
                kept = replace(turn, until=until) if turn is not None else None
                entries[k] = replace(entries[k], state=state, left=step, turns=kept)
        log = tuple(AppliedRequest(step=step, file=r.file, action=r.action, name=r.name) for r in requests)
        return Ledger(tuple(entries), self.applied + log)

    def revise(self, specs: Sequence[TaskSpec], revisions: Mapping[str, Sequence[Revision]]) -> Ledger:
        """The ledger with each revised task's spec now ``specs``'s (by name) and its ``revisions`` recorded."""
        by_name = {t.name: t for t in specs}
        entries = tuple(
            replace(e, spec=by_name[e.spec.name], revisions=(*e.revisions, *revisions[e.spec.name]))
            if e.spec.name in revisions
            else e
            for e in self.entries
        )
        return Ledger(entries, self.applied)

    def revisions(self) -> dict[str, tuple[Revision, ...]]:
        """Each task's hyperparameters changed on resumes (only the tasks with some)."""
        return {e.spec.name: e.revisions for e in self.entries if e.revisions}

    def queued(self) -> frozenset[str]:
        """Tasks whose share or deadline a queued update changed."""
        return frozenset(e.spec.name for e in self.entries if e.changes)

    def save(self, out: str | Path) -> None:
        write_json_as(Path(out) / LEDGER, LEDGER_FILE, LedgerFile(tasks=self.entries, applied=self.applied))

    @classmethod
    def load(cls, out: str | Path) -> Ledger | None:
        """The ledger of the run directory ``out``; None when it has none; InputError when it is not one."""
        path = Path(out) / LEDGER
        if not path.is_file():
            return None
        ledger = read_json_as(path, LEDGER_FILE, "task ledger")
        return cls(ledger.tasks, ledger.applied)


def revision_lines(out: str | Path) -> dict[str, list[str]]:
    """Per task of the run in ``out``, its revisions described (for the adapter cards); empty without a ledger."""
    ledger = Ledger.load(out)
    return {name: [describe(r) for r in rs] for name, rs in ledger.revisions().items()} if ledger else {}
