"""Queue request files: the folder they sit in, their kinds, their typed shapes, and a request once read.

A request file is YAML or JSON (:data:`REQUEST_SUFFIXES`) in the queue directory; a name starting with
``.`` is never read, so a writer can stage ``.name.json`` and rename it in. The watcher moves each file
it has judged to :data:`ACCEPTED` or :data:`REJECTED` (the reason beside it, :func:`reason_file`).
``lorafleet schema request`` prints the files' JSON Schema, generated from the three shapes here:
:class:`AddRequestFile`, :class:`UpdateRequestFile` and :class:`StopRequestFile`.

**Reach.** A task to add names data the run's user will read. Its data paths must resolve, symlinks
followed, inside the run's data roots (``--queue-data-root``; by default the folders that hold the
workload's own data: :func:`data_roots`), or the request is rejected (:func:`check_reach`) before any of
its data is read; and each must be a regular file or a directory (a saved dataset), never a FIFO, a device
or a socket, whose read would block rank 0 or never end. The queue's folders and reasons are the run user's
alone (:data:`PRIVATE_DIR`, :data:`PRIVATE_FILE`).

**Bounds.** A request file, and an HTTP body (``http.py``), is parsed by :func:`parse_request`: at most
:data:`MAX_REQUEST_BYTES`, nested at most :data:`MAX_DEPTH` deep, at most :data:`MAX_VALUES` values with YAML's
aliases expanded, JSON numbers finite, YAML by a safe loader (no objects built). Anything else is a RequestError
of one line, which the watcher rejects (the run goes on), never an error that ends the run.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from lorafleet.specs._base import Float, Int, Spec
from lorafleet.specs.field_docs import documented
from lorafleet.specs.workload import TaskSpec, describe_validation_error

REQUEST_SUFFIXES = (".yaml", ".yml", ".json")
"""The endings of the files in the queue directory that are requests."""
ACCEPTED = "accepted"
"""The folder of the queue directory that the requests applied are moved to."""
REJECTED = "rejected"
"""The folder of the queue directory that malformed requests are moved to, each with its reason file."""
PRIVATE_DIR = 0o700
"""The mode of the queue's folders the run creates (the queue, ``accepted``, ``rejected``)."""
PRIVATE_FILE = 0o600
"""The mode of the files the run writes there (a rejected request's reason)."""
UpdateKey = Literal["share", "deadline", "eval", "early_stopping"]
"""What an ``update`` may change of a running task (of its ``eval``, how often: :func:`updated_task`)."""
UPDATE_KEYS: tuple[UpdateKey, ...] = get_args(UpdateKey)
MAX_REQUEST_BYTES = 1 << 20
"""The largest request file, or HTTP body, read (a task's spec is a few hundred bytes)."""
MAX_DEPTH = 32
"""How deep a request's values may nest (a task's spec nests 4 deep); deeper is refused as it is parsed."""
MAX_VALUES = 1 << 20
"""How many values (mappings, lists, scalars) a request may hold, a YAML alias counted at every use: a file of
:data:`MAX_REQUEST_BYTES` holds fewer, so only aliases that expand (a "billion laughs") reach it."""

M = TypeVar("M", bound=BaseModel)


TOOK_ITS_STEPS = "(took its steps)"
"""The request file of a task that finished on its own (no file)."""
STOPPED_EARLY = "(stopped early)"
"""The request file of a task that early stopping made leave (``train.evaluation``; no file)."""
SWEEP_DROPPED = "(dropped by its sweep)"
"""The request file of a sweep's member that a rung of successive halving made leave (``lorafleet.sweeps``)."""
LEFT_ON_ITS_OWN = (TOOK_ITS_STEPS, STOPPED_EARLY, SWEEP_DROPPED)
"""How a task leaves without a request: a departure."""


class Action(StrEnum):
    """What a request asks of the run."""

    ADD = "add"
    """A task joins (the default action)."""
    FINISH = "finish"
    """A task stops and its adapter is exported; the ledger records it finished."""
    CANCEL = "cancel"
    """As finish; the ledger records it cancelled."""
    UPDATE = "update"
    """A running task's ``share`` and/or ``deadline`` change."""


class RequestError(ValueError):
    """A request that cannot be applied; the message is the reason (one line)."""


class MalformedRequest(RequestError):
    """A request that does not parse within bounds (:func:`parse_request`): "malformed JSON: <detail>"."""

    def __init__(self, kind: str, detail: str) -> None:
        self.detail = " ".join(detail.split())
        super().__init__(f"malformed {kind}: {self.detail}")


def request_files(directory: Path) -> list[Path]:
    """The request files in ``directory`` (not ``.``-named, ending in a request suffix), sorted by name;
    none when it does not exist."""
    if not directory.is_dir():
        return []
    return sorted(
        p for p in directory.iterdir() if not p.name.startswith(".") and p.suffix in REQUEST_SUFFIXES and p.is_file()
    )


def reason_file(rejected: Path) -> Path:
    """Where the reason of the rejected request file ``rejected`` is written: ``<file>.reason`` beside it."""
    return rejected.with_name(f"{rejected.name}.reason")


AtStep = Annotated[int, Field(ge=0, strict=True)]
"""A request's ``at_step``: not before this global step (a whole number, not a boolean)."""


class AddRequestFile(TaskSpec):
    """A task to add: a workload task, taken over the workload's ``defaults``, with the two keys of a request.
    The task needs ``data``; its relative data paths (``data``, ``lengths.dataset``) are relative to the
    request file."""

    action: Literal[Action.ADD] = Action.ADD
    """``add``, the default."""
    at_step: AtStep = 0
    """Not before this global step: it is applied at the first window boundary at or after it."""

    def task(self) -> TaskSpec:
        """The task alone, as a workload's task (the request's own keys left out)."""
        return TaskSpec.model_validate(self.model_dump(exclude={"action", "at_step"}, exclude_unset=True))


class UpdateRequestFile(Spec):
    """``{action: update, name: T, share: 0.3}`` (and/or ``deadline``, ``eval: {every_steps: N}``,
    ``early_stopping``): a running task's new share, deadline, evaluation cadence or early stopping, from the step
    it is applied at (:func:`updated_task`)."""

    action: Literal[Action.UPDATE]
    name: str = Field(min_length=1)
    """The running task."""
    at_step: AtStep = 0
    """Not before this global step."""
    share: Float | None = None
    """Its new ``share``, checked as the task's own."""
    deadline: Int | None = None
    """Its new ``deadline``, checked as the task's own (it needs ``steps``)."""
    eval: dict[str, Any] | None = None
    """Its ``eval``'s keys to change (``every_steps``), merged over its own and checked as the task's."""
    early_stopping: dict[str, Any] | None = None
    """Its ``early_stopping`` keys (null: none), merged over its own and checked as the task's."""

    @model_validator(mode="before")
    @classmethod
    def _share_or_deadline(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            changes = set(raw) - {"action", "name", "at_step"}
            if not changes or changes - set(UPDATE_KEYS):
                raise ValueError(f"update takes {', '.join(UPDATE_KEYS)}")
        return raw

    def changes(self) -> dict[UpdateKey, Any]:
        """The keys the file sets of :data:`UPDATE_KEYS`."""
        return self.model_dump(include=set(UPDATE_KEYS), exclude_unset=True)


def updated_task(task: TaskSpec, changes: Mapping[str, Any]) -> TaskSpec:
    """``task`` with an update's ``changes``: ``share`` and ``deadline`` replaced, ``eval`` and ``early_stopping``
    merged over its own (``early_stopping: null`` removes it), checked as a task (RequestError). Of its ``eval``, an
    update changes ``every_steps`` only: its ``split``, ``data`` and ``max_rows`` decided which rows it trains on and
    is evaluated on, and a task without an eval has trained on every row."""
    raw = task.model_dump()
    for key, value in changes.items():
        raw[key] = {**(raw.get(key) or {}), **value} if isinstance(value, Mapping) and raw.get(key) else value
    updated = validated(TaskSpec, raw)
    if "eval" in changes:
        if task.eval is None:
            raise RequestError("eval: the task has no eval: every row of its data is in training")
        if updated.eval is None or updated.eval.model_copy(update={"every_steps": task.eval.every_steps}) != task.eval:
            raise RequestError("eval: an update changes every_steps only (the rows held out are fixed at its start)")
    return updated


class StopRequestFile(Spec):
    """``{action: finish, name: T}`` or ``{action: cancel, name: T}``: task ``T`` stops at the step it is applied
    at, and its adapter is exported to ``<out>/adapters/T``."""

    action: Literal[Action.FINISH, Action.CANCEL]
    name: str = Field(min_length=1)
    """The running task."""
    at_step: AtStep = 0
    """Not before this global step."""

    @model_validator(mode="before")
    @classmethod
    def _only_the_name(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            unknown = sorted(set(raw) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"{raw.get('action')} takes only the task's name, got {', '.join(unknown)}")
        return raw


@dataclass(frozen=True)
class Request:
    """One request, validated against the run (``watcher.read_request``); the pending-changes file holds them."""

    __pydantic_config__ = documented(extra="forbid")

    file: str
    """Its file's name in the queue directory."""
    action: Action
    name: str
    """The task it is about."""
    at_step: Int = 0
    """Not before this global step."""
    task: TaskSpec | None = None
    """``add``: the task (data paths absolute; ``start_step`` set when it is applied)."""
    changes: Mapping[UpdateKey, Any] = field(default_factory=dict)
    """``update``: the new ``share``, ``deadline``, ``eval`` keys and/or ``early_stopping`` (:func:`updated_task`)."""


def read_request_file(path: Path) -> tuple[Action, dict[str, Any]]:
    """A request file's action and mapping, the keys every request has checked first, each with a sentence of
    its own (``action``, ``at_step``, ``name``); RequestError."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_REQUEST_BYTES + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RequestError(f"cannot read it ({err})") from None
    if len(data) > MAX_REQUEST_BYTES:
        raise RequestError(f"over {MAX_REQUEST_BYTES:,} bytes")
    raw = parse_request(text, "JSON" if path.suffix == ".json" else "YAML")
    if not isinstance(raw, dict):
        raise RequestError(f"expected a mapping, got {type(raw).__name__}")
    try:
        action = Action(raw.get("action", Action.ADD))
    except ValueError:
        raise RequestError(f"action must be one of {', '.join(Action)}") from None
    at_step = raw.get("at_step", 0)
    if not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 0:
        raise RequestError(f"at_step must be a whole number >= 0, got {at_step!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("needs the task's name")
    return action, raw


def data_paths(task: TaskSpec) -> Iterator[tuple[str, str]]:
    """(field, path) of each data path of ``task``: ``data`` and ``lengths.dataset``."""
    if task.data is not None:
        yield "data", task.data.path
    if task.lengths is not None and task.lengths.dataset is not None:
        yield "lengths.dataset", task.lengths.dataset.path


def data_roots(tasks: Sequence[TaskSpec]) -> tuple[str, ...]:
    """The default data roots: the folder that holds each data path of ``tasks`` (a JSONL file's folder, a saved
    dataset's parent), symlinks resolved, each once, in order."""
    return tuple(dict.fromkeys(os.path.realpath(Path(path).parent) for t in tasks for _, path in data_paths(t)))


def check_reach(task: TaskSpec, roots: Sequence[str] | None) -> None:
    """A RequestError when a data path of ``task`` (absolute) resolves, symlinks followed, outside every one of
    ``roots`` (resolved folders; None: anywhere), or inside them to something other than a regular file or a
    directory (a FIFO, a device, a socket: :func:`data_kind`). The reason names the path as the request gave it,
    never where it leads; what a path outside the roots is, is never looked at."""
    for where, path in data_paths(task):
        real = Path(os.path.realpath(path))
        if roots is not None and not any(real.is_relative_to(root) for root in roots):
            raise RequestError(f"{where}: {path} is outside the folders this run takes data from (--queue-data-root)")
    for where, path in data_paths(task):
        kind = data_kind(path)
        if kind is not None:
            raise RequestError(f"{where}: {path} is {kind}, not a file or a saved dataset's directory")


def data_kind(path: str | Path) -> str | None:
    """What ``path`` is, symlinks followed, when it is neither a regular file nor a directory ("a FIFO", "a
    character device", ...); None for those two, and for a path that does not exist (its read says so)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def parse_request(text: str, kind: Literal["JSON", "YAML"]) -> Any:
    """``text`` (at most :data:`MAX_REQUEST_BYTES`, checked by the caller) parsed as ``kind``, within the module
    doc's bounds; a RequestError of one line ("malformed YAML: ...") for anything else. JSON's numbers must be
    finite (``1e999`` would be written back as ``Infinity``); YAML builds plain values only."""
    try:
        if kind == "JSON":
            raw = json.loads(text, parse_constant=_not_finite, parse_float=_finite)
        else:
            raw = yaml.load(text, Loader=_RequestLoader)  # a SafeLoader, bounded
    except RecursionError:  # JSON's C parser recurses first: Python's limit is met before MAX_DEPTH is checked
        raise MalformedRequest(kind, f"nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, yaml.YAMLError) as err:  # json.JSONDecodeError is a ValueError
        lines = str(err).strip().splitlines() or [type(err).__name__]
        raise MalformedRequest(kind, lines[0]) from None
    _check_bounds(raw, kind)
    return raw


def _finite(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"{token} is not a finite number")
    return value


def _not_finite(token: str) -> Any:
    raise ValueError(f"{token} is not a finite number")


class _RequestLoader(yaml.SafeLoader):
    """PyYAML's safe loader (plain values only) that refuses a document nested deeper than :data:`MAX_DEPTH`
    before its recursive composer reaches Python's recursion limit."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _check_bounds(raw: Any, kind: str) -> None:
    """RequestError when ``raw`` nests deeper than :data:`MAX_DEPTH` or holds more than :data:`MAX_VALUES` values,
    each shared (aliased) value counted at every use; walked without recursion, a cycle stopped by the depth."""
    stack, values = [(raw, 1)], 0
    while stack:
        value, depth = stack.pop()
        values += 1
        if depth > MAX_DEPTH:
            raise MalformedRequest(kind, f"nested deeper than {MAX_DEPTH} levels")
        if values > MAX_VALUES:
            raise MalformedRequest(kind, f"more than {MAX_VALUES:,} values (YAML aliases counted at each use)")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def validated(model: type[M], raw: Mapping[str, Any]) -> M:
    """``raw`` as ``model``; a RequestError naming the field path of the first wrong value (an unknown key is one)."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        where, message = describe_validation_error(err.errors()[0])
        raise RequestError(f"{where}: {message}" if where else message) from None
