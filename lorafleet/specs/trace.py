"""Arrival traces: the file that ``lorafleet simulate WORKLOAD --arrivals TRACE`` replays (docs/arrivals.md).

A trace (YAML) has one key, ``events``, a list sorted by ``at``::

    events:
      - {at: 0,    add: {name: chat2, preset: dolly, steps: 30}}
      - {at: 600,  add: {name: summ, lengths: {mean: 2500, skewness: 1, kurtosis: 1},
                         batch_size: 16, context_length: 8192, steps: 40}}
      - {at: 900,  cancel: chat2}

Each event has ``at`` (seconds of simulated time, a finite number >= 0; events sorted by it) and
exactly one of ``add`` (a task, in the workload file's task schema: the workload's ``defaults:``
apply, and it needs ``steps``) or ``cancel`` (the name of a task of the workload or added by an
earlier event). The workload's own tasks need ``steps`` too. ``share``, ``deadline`` and
``start_step`` are refused: a replayed task takes part in every step from its arrival to its
departure. Every bad event is an InputError naming the field (``events[3].add.batch_size``): a
task name that is taken, a cancel of a task not yet added or already cancelled, events out of
order, a task without steps.

This module checks the file against the workload's spec only; resolving the added tasks (their
length distributions, dataset paths relative to the trace file) is ``lorafleet.arrivals.trace``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lorafleet.errors import InputError
from lorafleet.specs.workload import TaskSpec, WorkloadSpec, deep_merge, describe_validation_error

EVENT_KEYS = ("at", "add", "cancel")
UNSUPPORTED = ("share", "deadline", "start_step")
"""Task fields a trace refuses: a task here takes part in every step from its arrival to its departure."""


@dataclass(frozen=True)
class AddEvent:
    """A task the trace adds, validated (the workload's defaults merged in) but not yet resolved."""

    at_s: float
    spec: TaskSpec
    where: str
    """Its field in the trace file: ``events[4].add``."""


@dataclass(frozen=True)
class Cancel:
    """A task's departure before it has taken its steps."""

    at_s: float
    task: str


@dataclass(frozen=True)
class TraceSpec:
    """A trace file's events, checked against its workload: adds and cancels, each in file order."""

    path: str
    adds: tuple[AddEvent, ...]
    cancels: tuple[Cancel, ...]


def check_replayed_task(spec: TaskSpec, path: str, where: str, what: str) -> None:
    """A task of a replayed run needs steps and takes part in every step while present."""
    if spec.steps is None:
        why = " (epochs are not replayed: give steps)" if spec.epochs is not None else ""
        raise InputError(path, f"{where}.steps", f"{what} needs steps: it departs once it has taken them{why}")
    for name in UNSUPPORTED:
        value = getattr(spec, name)
        if value is not None and value != 0:
            raise InputError(
                path,
                f"{where}.{name}",
                f"not supported with --arrivals (a task takes part in every step from its arrival to its "
                f"departure; its arrival is its event's at), got {value!r}",
            )


def check_replayed_workload(workload: WorkloadSpec, path: str) -> None:
    """Every task of the workload ``path`` can be replayed (:func:`check_replayed_task`)."""
    for k, task in enumerate(workload.tasks):
        check_replayed_task(task, path, f"tasks[{k}]", f"with --arrivals, task {task.name!r}")


def _seconds(value: Any, path: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(path, where, f"must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise InputError(path, where, f"must be a finite number >= 0, got {value!r}")
    return float(value)


def _events(raw: Any, path: str) -> list:
    """The ``events`` list of a trace file's contents (None: no events)."""
    if not isinstance(raw, dict) or "events" not in raw:
        got = type(raw).__name__ if not isinstance(raw, dict) else f"keys {sorted(raw)}"
        raise InputError(path, "", f"expected a mapping with an 'events' list, got {got}")
    extra = sorted(set(raw) - {"events"})
    if extra:
        raise InputError(path, str(extra[0]), "unknown key (a trace has only 'events')")
    events = raw["events"]
    if events is None:
        return []
    if not isinstance(events, list):
        raise InputError(path, "events", f"must be a list of events, got {type(events).__name__}")
    return events


def _event_time(event: Any, path: str, here: str) -> float:
    """An event's ``at``, after its shape: a mapping of ``at`` and exactly one of ``add``, ``cancel``."""
    if not isinstance(event, dict):
        raise InputError(path, here, f"must be a mapping with at and add or cancel, got {event!r}")
    unknown = sorted(set(event) - set(EVENT_KEYS), key=str)
    if unknown:
        raise InputError(path, f"{here}.{unknown[0]}", "unknown key (an event has at and one of add, cancel)")
    if "at" not in event:
        raise InputError(path, f"{here}.at", "missing: the event's time in seconds")
    return _seconds(event["at"], path, f"{here}.at")


def _added_task(body: Any, defaults: dict, path: str, where: str) -> TaskSpec:
    if not isinstance(body, dict):
        raise InputError(path, where, f"must be a task mapping, got {body!r}")
    try:
        return TaskSpec.model_validate(deep_merge(defaults, body))
    except ValidationError as err:
        loc, msg = describe_validation_error(err.errors()[0])
        raise InputError(path, f"{where}.{loc}" if loc else where, msg) from None


def parse_trace(raw: Any, path: str, workload: WorkloadSpec) -> TraceSpec:
    """Check the contents ``raw`` of the trace file ``path`` against ``workload`` (module docstring): every
    problem is an InputError naming its field. The workload's own tasks are checked by
    :func:`check_replayed_workload`."""
    defined = {t.name: f"task {t.name!r} is in the workload" for t in workload.tasks}
    cancelled: dict[str, int] = {}
    adds: list[AddEvent] = []
    cancels: list[Cancel] = []
    last = 0.0
    for i, event in enumerate(_events(raw, path)):
        here = f"events[{i}]"
        at = _event_time(event, path, here)
        if at < last:
            raise InputError(path, f"{here}.at", f"events must be sorted by at: {at:g} comes after {last:g}")
        last = at
        if ("add" in event) == ("cancel" in event):
            raise InputError(path, here, "needs exactly one of add (a task) or cancel (a task name)")
        if "cancel" in event:
            name = event["cancel"]
            where = f"{here}.cancel"
            if not isinstance(name, str):
                raise InputError(path, where, f"must be a task name, got {name!r}")
            if name not in defined:
                raise InputError(
                    path, where, f"unknown task {name!r}: not in the workload nor added by an earlier event"
                )
            if name in cancelled:
                raise InputError(path, where, f"task {name!r} is already cancelled by events[{cancelled[name]}]")
            cancelled[name] = i
            cancels.append(Cancel(at, name))
            continue
        where = f"{here}.add"
        spec = _added_task(event["add"], workload.defaults, path, where)
        if spec.name in defined:
            raise InputError(path, f"{where}.name", f"task name {spec.name!r} is taken: {defined[spec.name]}")
        check_replayed_task(spec, path, where, f"task {spec.name!r}")
        defined[spec.name] = f"added by {here}"
        adds.append(AddEvent(at, spec, where))
    return TraceSpec(path=path, adds=tuple(adds), cancels=tuple(cancels))
