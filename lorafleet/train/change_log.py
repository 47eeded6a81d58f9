"""The run's record of its fleet changes, ``<out>/changes.jsonl``: one JSON row per boundary where tasks changed
(a queued request, a task that took its steps) and per re-plan answer applied at its boundary.

The log lines say the same in prose; these rows are what tools and tests read. Each row is a :class:`ChangeRecord`
(typed: :func:`read_changes` reads them back, unknown keys refused; ``lorafleet schema changes`` prints its JSON
Schema). A row
is appended once the change is settled (the ledger and the plan written, ``.apply.json`` removed), so a crash
before leaves none and the change, applied again by the launcher, writes it then; a resume from an earlier
checkpoint drops the rows after that step, as it drops the metrics of the steps it replays
(:func:`truncate_changes`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from pydantic import TypeAdapter

from lorafleet.specs._base import Int
from lorafleet.specs.field_docs import documented
from lorafleet.specs.io import write_text_atomic
from lorafleet.train.queue.requests import (  # how a task leaves without a request: named with the requests
    LEFT_ON_ITS_OWN,
    STOPPED_EARLY,
    SWEEP_DROPPED,
    TOOK_ITS_STEPS,
    Action,
    Request,
)

__all__ = ["LEFT_ON_ITS_OWN", "STOPPED_EARLY", "SWEEP_DROPPED", "TOOK_ITS_STEPS"]


class ChangeKind(StrEnum):
    """What a row records."""

    CHANGE = "change"
    """Requests from the queue were applied at the boundary (with the departures due there, if any)."""
    DEPARTURE = "departure"
    """Only tasks that took their steps left (no request)."""
    REPLAN = "replan"
    """The answer of a re-plan that ran beside the steps, applied at its boundary."""

    @classmethod
    def of(cls, requests: Sequence[Request]) -> ChangeKind:
        """A boundary's kind by its requests: none is a re-plan's move (handed to the launcher), a departure when
        every one is a task that took its steps."""
        if not requests:
            return cls.REPLAN
        return cls.DEPARTURE if all(r.file in LEFT_ON_ITS_OWN for r in requests) else cls.CHANGE


class Outcome(StrEnum):
    """What the fleet did (``planner.decision``)."""

    KEPT = "kept"
    """The running deployment serves on (its adapter slots changed in place); no re-plan."""
    KEPT_REPLANNING = "kept-replanning"
    """Kept for now; the re-plan runs beside the steps, its answer due at ``replan_at``."""
    MOVED = "moved"
    """The fleet moved to another deployment in its running processes."""
    HANDED_OFF = "handed-off"
    """The new plan needs more processes than the run has: the workers stop and the launcher applies it."""
    RELAUNCHED = "relaunched"
    """The launcher applied the change between two launches (``train.live.apply_pending``)."""
    ALL_LEFT = "all-left"
    """No task is left to train."""
    SETTLED = "settled"
    """A change applied before a restart, whose checkpoint the run resumed from, settled after it
    (``train.inflight``)."""


@dataclass(frozen=True)
class RequestRow:
    """One request of a change."""

    __pydantic_config__ = documented(extra="forbid")

    action: Action
    name: str
    """The task."""
    file: str
    """The request file, or how the change came (``(took its steps)``)."""


@dataclass(frozen=True)
class ChangeRecord:
    """One row of ``changes.jsonl``."""

    __pydantic_config__ = documented(extra="forbid")

    step: Int
    """The boundary: the first step run after it."""
    kind: ChangeKind
    outcome: Outcome
    tasks: tuple[str, ...]
    """The tasks the fleet trains from ``step`` on."""
    plan: str
    """The deployment from ``step`` on (``DeploymentPlan.describe``)."""
    requests: tuple[RequestRow, ...] = ()
    seconds: float = 0.0
    """Wall seconds the fleet spent applying it in place (0: nothing applied in the running processes)."""
    rebuilt: tuple[Int, ...] = ()
    """The ranks that built a new stage."""
    replan_at: Int | None = None
    """``kept-replanning``: the boundary the re-plan beside the steps answers at."""
    replanned_for: Int | None = None
    """``replan``: the boundary of the change the answer is for."""
    waited_s: float = 0.0
    """``replan``: seconds the boundary waited for the answer."""
    note: str = ""
    """The re-plan's reason, in words (``Replan.describe``), when one was made at this boundary."""
    extra: dict[str, float] = field(default_factory=dict)
    """Per phase of an in-place change, its seconds (``executor.torch.change.PHASES``)."""


CHANGE_RECORD = TypeAdapter(ChangeRecord)


def request_rows(requests: Sequence[Request]) -> tuple[RequestRow, ...]:
    return tuple(RequestRow(r.action, r.name, r.file) for r in requests)


def append_change(path: Path, record: ChangeRecord) -> None:
    """Append ``record`` to ``path`` (one line, flushed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(_line(record))
        f.flush()


def read_changes(path: Path) -> list[ChangeRecord]:
    """The rows of ``path`` (none when it does not exist)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    return [CHANGE_RECORD.validate_json(line) for line in text.splitlines() if line.strip()]


def truncate_changes(path: Path, step: int) -> None:
    """Keep the rows of boundaries up to ``step`` (a run resumed from step ``step`` applies the later ones again),
    rewritten whole."""
    rows = read_changes(path)
    kept = [r for r in rows if r.step <= step]
    if len(kept) != len(rows):
        write_text_atomic(path, "".join(map(_line, kept)))


def _line(record: ChangeRecord) -> str:
    return json.dumps(CHANGE_RECORD.dump_python(record, mode="json"), sort_keys=True) + "\n"
