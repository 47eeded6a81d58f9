"""The pending changes, ``<queue>/.apply.json``: a boundary's requests, from the moment they are due until they
are applied.

Rank 0 writes it when requests are due (after the boundary's checkpoint, when a task joins or leaves), and
removes it once it has applied them in the running fleet (``train.changes``); what the fleet cannot apply,
or what a crash left, the launcher applies between two launches (``train.live.apply_pending``). Its name
starts with ``.``, so the watcher never reads it as a request. The file is typed (:data:`PENDING_FILE`:
unknown keys refused, a wrong value named by its field path); ``lorafleet schema pending`` prints its JSON
Schema.

**A re-plan under way**, ``<queue>/.replan.json`` (:class:`PendingReplan`). A change the running deployment
can serve is applied on it at once, and the incremental re-plan runs beside the next steps
(``train.background``); the move it finds, if any, is applied a fixed number of steps later. The file says so
from the change's boundary until that step's boundary, so a resume in between runs the re-plan again and
applies its answer at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ConfigDict, TypeAdapter

from lorafleet.rundir import PENDING, PENDING_REPLAN
from lorafleet.specs._base import Int
from lorafleet.specs.io import read_json_as, write_json_as
from lorafleet.train.queue.requests import Request
from lorafleet.turns import TaskTurns


@dataclass(frozen=True)
class Pending:
    """A boundary's changes until they are applied: the requests due, and the running tasks' turns."""

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    step: Int
    """The boundary: the first step with the changes (its checkpoint's, when a task joins or leaves)."""
    requests: list[Request]
    """The requests due there, in the order the watcher took them."""
    turns: dict[str, TaskTurns] = field(default_factory=dict)
    """The running tasks' turns, by name (the ledger keeps those of the tasks that leave)."""


PENDING_FILE = TypeAdapter(Pending)


@dataclass(frozen=True)
class PendingReplan:
    """An incremental re-plan running beside the steps: for the tasks of boundary ``step``, applied at ``at``."""

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
