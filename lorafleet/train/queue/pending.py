"""The pending changes, ``<queue>/.apply.json``: what the workers hand the launcher at a boundary.

Rank 0 writes it when requests are due (the run then checkpoints and its workers exit); the launcher
applies it between two launches (``train.live``) and removes it. Its name starts with ``.``, so the
watcher never reads it as a request. The file is typed (:data:`PENDING_FILE`: unknown keys refused, a
wrong value named by its field path); ``lorafleet schema pending`` prints its JSON Schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ConfigDict, TypeAdapter

from lorafleet.specs._base import Int
from lorafleet.specs.io import read_json_as, write_json_as
from lorafleet.train.queue.requests import Request
from lorafleet.turns import TaskTurns

PENDING = ".apply.json"
"""In the queue directory: the requests accepted at a boundary, until the restart has applied them."""


@dataclass(frozen=True)
class Pending:
    """What the workers hand the launcher at a boundary: the requests due, and the running tasks' turns."""

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    step: Int
    """The boundary: the step the run checkpointed at and resumes from."""
    requests: list[Request]
    """The requests due there, in the order the watcher took them."""
    turns: dict[str, TaskTurns] = field(default_factory=dict)
    """The running tasks' turns, by name (the ledger keeps those of the tasks that leave)."""


PENDING_FILE = TypeAdapter(Pending)


def save_pending(directory: str | Path, pending: Pending) -> None:
    """The requests accepted at the boundary before ``pending.step``, for the restart to apply."""
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
