"""The live task queue of a running ``lorafleet train``: request files, and the run's task ledger.

**Requests.** A directory (``--queue``, by default ``<out>/queue``) of files, one request each, YAML or
JSON (``*.yaml``, ``*.yml``, ``*.json``; names starting with ``.`` are ignored, so a writer can stage a
file as ``.name`` and rename it in). A request is

- a task to **add**: a workload task, the same schema and the workload's ``defaults`` (relative data
  paths are relative to the request file); it needs ``data``. Optional keys: ``action: add``,
  ``at_step`` (not before this global step), and the task's own ``share``/``deadline``;
- ``{action: finish, name: T}`` or ``{action: cancel, name: T}``: task ``T`` stops; its adapter is
  exported to ``<out>/adapters/T`` (finish and cancel differ only in what the ledger records);
- ``{action: update, name: T, share: 0.3}`` (and/or ``deadline``): a new share or deadline.

**When.** Rank 0 reads the queue at every window boundary (``QueueWatcher.poll``). A malformed request is
*rejected*: one line in the run's log, and the file moved to ``queue/rejected/`` beside a
``<file>.reason``; the run goes on. Valid requests that are due (``at_step`` reached) are *accepted*
(moved to ``queue/accepted/``) and applied together at that boundary: the run checkpoints, the changes
go into the ledger, the deployment is re-planned incrementally (``planner.incremental``) and the run
restarts from the checkpoint (``train.live``). A request whose ``at_step`` is still ahead waits, and
the run ends a window at that step.

**Ledger.** ``<out>/tasks.json``: every task the run has had, in order, with its spec (paths absolute,
``start_step`` the step it joined at), its state (``active``, ``finished``, ``cancelled``) and the step it
left at; and the requests applied, by step. A resume trains the ledger's active tasks.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lorafleet.errors import InputError
from lorafleet.specs.workload import TaskSpec, deep_merge, describe_validation_error
from lorafleet.turns import TaskTurns

REQUEST_SUFFIXES = (".yaml", ".yml", ".json")
LEDGER = "tasks.json"
PENDING = ".apply.json"
"""In the queue directory: the requests accepted at a boundary, until the restart has applied them."""
QUEUE_KEYS = ("action", "at_step")


class Action(StrEnum):
    ADD = "add"
    FINISH = "finish"
    CANCEL = "cancel"
    UPDATE = "update"


class TaskState(StrEnum):
    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"


class RequestError(ValueError):
    """A request that cannot be applied; the message is the reason (one line)."""


@dataclass(frozen=True)
class Request:
    """One validated request."""

    file: str
    """Its file's name in the queue directory."""
    action: Action
    name: str
    at_step: int = 0
    task: TaskSpec | None = None
    """The task to add (``start_step`` set when it is applied)."""
    changes: Mapping[str, Any] = field(default_factory=dict)
    """``update``: the new ``share`` and/or ``deadline``."""

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "action": self.action.value,
            "name": self.name,
            "at_step": self.at_step,
            "task": self.task.model_dump(mode="json") if self.task is not None else None,
            "changes": dict(self.changes),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Request:
        task = raw.get("task")
        return cls(
            file=raw["file"],
            action=Action(raw["action"]),
            name=raw["name"],
            at_step=int(raw.get("at_step", 0)),
            task=TaskSpec.model_validate(task) if task is not None else None,
            changes=dict(raw.get("changes", {})),
        )


Change = tuple[int, float | None, int | None]
"""``(step, share, deadline)``: from that step on (``turns.TaskTurns.changes``)."""


@dataclass(frozen=True)
class LedgerEntry:
    spec: TaskSpec
    state: TaskState = TaskState.ACTIVE
    left: int | None = None
    """The step it left the run at (finished or cancelled)."""
    changes: tuple[Change, ...] = ()
    """Its share and deadline over time, from its start, once an update changed them (else empty)."""
    turns: TaskTurns | None = None
    """Its turns as the run drew them when it left (``lorafleet.turns``; the streams of the tasks that stay
    redraw the steps before it left with it)."""


@dataclass(frozen=True)
class Ledger:
    """Every task the run has had (module doc)."""

    entries: tuple[LedgerEntry, ...]
    applied: tuple[dict[str, Any], ...] = ()
    """``{"step", "file", "action", "name"}`` of every request applied, in order."""

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
        (kept for those that leave)."""
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
                spec = e.spec.model_copy(update=dict(r.changes))
                history = e.changes or ((e.spec.start_step, e.spec.share, e.spec.deadline),)
                entries[k] = replace(e, spec=spec, changes=(*history, (step, spec.share, spec.deadline)))
            else:
                state = TaskState.FINISHED if r.action is Action.FINISH else TaskState.CANCELLED
                turn = (turns or {}).get(r.name)
                until = step if turn is None or turn.until is None else min(step, turn.until)
                kept = replace(turn, until=until) if turn is not None else None
                entries[k] = replace(entries[k], state=state, left=step, turns=kept)
        log = tuple({"step": step, "file": r.file, "action": r.action.value, "name": r.name} for r in requests)
        return Ledger(tuple(entries), self.applied + log)

    def to_json(self) -> dict[str, Any]:
        return {
            "tasks": [
                {
                    "spec": e.spec.model_dump(mode="json", exclude_none=True),
                    "state": e.state.value,
                    "left": e.left,
                    "changes": [list(c) for c in e.changes],
                    "turns": _turns_json(e.turns),
                }
                for e in self.entries
            ],
            "applied": list(self.applied),
        }

    def save(self, out: str | Path) -> None:
        _write_json(Path(out) / LEDGER, self.to_json())

    @classmethod
    def load(cls, out: str | Path) -> Ledger | None:
        path = Path(out) / LEDGER
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(
                tuple(
                    LedgerEntry(
                        TaskSpec.model_validate(t["spec"]),
                        TaskState(t["state"]),
                        t.get("left"),
                        tuple((int(c[0]), c[1], c[2]) for c in t.get("changes", ())),
                        _turns_of(t.get("turns")),
                    )
                    for t in raw["tasks"]
                ),
                tuple(raw.get("applied", ())),
            )
        except (ValueError, KeyError, TypeError, ValidationError) as err:
            raise InputError(str(path), "", f"not a lorafleet task ledger ({err})") from None


def _turns_json(turns: TaskTurns | None) -> dict[str, Any] | None:
    if turns is None:
        return None
    return {**asdict(turns), "changes": [list(c) for c in turns.changes]}


def _turns_of(raw: Mapping[str, Any] | None) -> TaskTurns | None:
    if raw is None:
        return None
    return TaskTurns(**{**raw, "changes": tuple((int(c[0]), c[1], c[2]) for c in raw.get("changes", ()))})


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RequestError(f"cannot read it ({err})") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise RequestError(f"malformed {kind}: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise RequestError(f"expected a mapping, got {type(raw).__name__}")
    return raw


def _resolve(spec: TaskSpec, base: Path) -> TaskSpec:
    """Relative data paths of a request are relative to its file."""
    if spec.data is None or Path(spec.data.path).is_absolute():
        return spec
    return spec.model_copy(update={"data": spec.data.model_copy(update={"path": str(base / spec.data.path)})})


def read_request(path: Path, defaults: Mapping[str, Any], ledger: Ledger) -> Request:
    """A request file, validated against the run's ``ledger`` (``defaults``: the workload's); RequestError."""
    raw = _read_mapping(path)
    try:
        action = Action(raw.pop("action", Action.ADD.value))
    except ValueError:
        raise RequestError(f"action must be one of {', '.join(a.value for a in Action)}") from None
    at_step = raw.pop("at_step", 0)
    if not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 0:
        raise RequestError(f"at_step must be a whole number >= 0, got {at_step!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("needs the task's name")
    active = {t.name for t in ledger.active}
    if action is Action.ADD:
        if name in ledger.names():
            raise RequestError(f"task {name!r} is already in this run (task names name their adapters)")
        try:
            task = TaskSpec.model_validate(deep_merge(dict(defaults), raw))
        except ValidationError as err:
            where, message = describe_validation_error(err.errors()[0])
            raise RequestError(f"{where}: {message}" if where else message) from None
        if task.data is None:
            raise RequestError("data: training needs data (a JSONL file or a saved dataset)")
        return Request(path.name, action, name, at_step, task=_resolve(task, path.parent))
    if name not in active:
        raise RequestError(f"no active task {name!r} in this run (active: {', '.join(sorted(active)) or 'none'})")
    if action is Action.UPDATE:
        changes = {k: v for k, v in raw.items() if k != "name"}
        if not changes or set(changes) - {"share", "deadline"}:
            raise RequestError("update takes share and/or deadline")
        current = next(t for t in ledger.active if t.name == name)
        try:
            TaskSpec.model_validate({**current.model_dump(), **changes})
        except ValidationError as err:
            where, message = describe_validation_error(err.errors()[0])
            raise RequestError(f"{where}: {message}" if where else message) from None
        return Request(path.name, action, name, at_step, changes=changes)
    if set(raw) - {"name"}:
        raise RequestError(f"{action.value} takes only the task's name, got {', '.join(sorted(set(raw) - {'name'}))}")
    return Request(path.name, action, name, at_step)


class QueueWatcher:
    """Rank 0's view of the queue directory (module doc)."""

    def __init__(
        self,
        directory: str | Path,
        defaults: Mapping[str, Any],
        ledger: Ledger,
        check: Callable[[TaskSpec], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        """``check`` vets a task to add beyond its schema (its data tokenizes): raises InputError or ValueError."""
        self.directory = Path(directory)
        self.defaults = dict(defaults)
        self.ledger = ledger
        self.check = check
        self.log = log or (lambda line: print(f"lorafleet train: queue: {line}", file=sys.stderr, flush=True))
        self.waiting: dict[str, Request] = {}
        """Valid requests whose ``at_step`` is still ahead, by file."""

    def files(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(
            p
            for p in self.directory.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix in REQUEST_SUFFIXES
        )

    def poll(self, step: int) -> list[Request]:
        """The requests due at the boundary before ``step`` (moved to ``accepted/``); malformed ones are rejected.
        Requests later in the list see the ones before them (an add then an update of the same task)."""
        due: list[Request] = []
        ledger = self.ledger
        for path in self.files():
            try:
                request = self.waiting.get(path.name) or read_request(path, self.defaults, ledger)
                if request.task is not None and self.check is not None and path.name not in self.waiting:
                    try:
                        self.check(request.task)
                    except (InputError, ValueError) as err:
                        raise RequestError(str(err)) from None
            except RequestError as err:
                self.reject(path, str(err))
                continue
            if request.at_step > step:
                self.waiting[path.name] = request
                continue
            self.waiting.pop(path.name, None)
            if request.task is not None:
                try:  # a deadline is checked against the step the task starts at
                    TaskSpec.model_validate({**request.task.model_dump(), "start_step": step})
                except ValidationError as err:
                    self.reject(path, describe_validation_error(err.errors()[0])[1])
                    continue
            due.append(request)
            ledger = ledger.apply([request], step)
        for request in due:
            _move(self.directory / request.file, self.directory / "accepted")
        return due

    def next_due(self) -> int | None:
        """The earliest ``at_step`` of the requests waiting."""
        return min((r.at_step for r in self.waiting.values()), default=None)

    def reject(self, path: Path, reason: str) -> None:
        """One log line; the file moved to ``rejected/`` with ``<file>.reason``."""
        reason = " ".join(reason.split())
        self.log(f"rejected {path.name}: {reason}")
        target = _move(path, self.directory / "rejected")
        target.with_name(f"{target.name}.reason").write_text(reason + "\n")
        self.waiting.pop(path.name, None)


def _move(path: Path, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / path.name
    if target.exists():
        stem, n = target.stem, 1
        while (target := directory / f"{stem}-{n}{path.suffix}").exists():
            n += 1
    shutil.move(str(path), target)
    return target


@dataclass(frozen=True)
class Pending:
    """What the workers hand the launcher at a boundary: the requests due, and the running tasks' turns."""

    step: int
    requests: list[Request]
    turns: dict[str, TaskTurns] = field(default_factory=dict)


def save_pending(directory: str | Path, pending: Pending) -> None:
    """The requests accepted at the boundary before ``pending.step``, for the restart to apply."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    _write_json(
        Path(directory) / PENDING,
        {
            "step": pending.step,
            "requests": [r.to_json() for r in pending.requests],
            "turns": {name: _turns_json(t) for name, t in pending.turns.items()},
        },
    )


def load_pending(directory: str | Path) -> Pending | None:
    path = Path(directory) / PENDING
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    turns = {name: _turns_of(t) for name, t in raw.get("turns", {}).items()}
    return Pending(int(raw["step"]), [Request.from_json(r) for r in raw["requests"]], turns)


def has_pending(directory: str | Path) -> bool:
    return (Path(directory) / PENDING).is_file()


def clear_pending(directory: str | Path) -> None:
    (Path(directory) / PENDING).unlink(missing_ok=True)
