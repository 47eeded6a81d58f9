"""A trace resolved against its workload: every task of the run with its length distribution and arrival.

The file's format and checks are :mod:`lorafleet.specs.trace`'s. Here the added tasks are resolved as
the workload's are (their dataset paths relative to the trace file), and an error in one is named at
its event (``events[3].add.lengths``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lorafleet.errors import InputError
from lorafleet.specs.trace import Cancel, check_replayed_workload, parse_trace
from lorafleet.specs.workload import TaskSpec, resolve_data_paths
from lorafleet.workload import Task, Workload, read_yaml, resolve_workload


@dataclass(frozen=True)
class Arrival:
    """A task and when it arrives."""

    task: Task
    at_s: float
    source: tuple[str, str]
    """(file, field) where the task is defined: ``(workload, "tasks[2]")`` or ``(trace, "events[4].add")``."""


@dataclass(frozen=True)
class Trace:
    """A workload and a trace of arrivals and departures, validated and resolved."""

    path: str
    workload: Workload
    arrivals: tuple[Arrival, ...]
    """The workload's tasks (at 0) first, then the trace's, in trace order."""
    cancels: tuple[Cancel, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.task.name for a in self.arrivals)

    def arrival(self, name: str) -> Arrival:
        return next(a for a in self.arrivals if a.task.name == name)

    def subset(self, names: Sequence[str]) -> Workload:
        """The workload of the tasks ``names``, in that order (planned and dispatched as one)."""
        tasks = tuple(self.arrival(n).task for n in names)
        spec = self.workload.spec.model_copy(update={"tasks": tuple(t.spec for t in tasks)})
        return Workload(path=self.workload.path, spec=spec, model=self.workload.model, tasks=tasks)

    def all_tasks(self) -> Workload:
        """Every task of the workload and the trace (what ``static`` plans for, and the cost model's adapters)."""
        return self.subset(self.names)


def _resolve_added(workload: Workload, spec: TaskSpec, path: str, where: str) -> Task:
    """The added task's length distribution, errors named at its event."""
    try:
        resolved = resolve_workload(workload.spec.model_copy(update={"tasks": (spec,)}), path)
    except InputError as err:
        if err.path == path and err.field.startswith("tasks[0]"):
            raise InputError(path, where + err.field.removeprefix("tasks[0]"), err.msg) from None
        raise
    return resolved.tasks[0]


def load_trace(path: str | Path, workload: Workload) -> Trace:
    """Read, check (:func:`lorafleet.specs.trace.parse_trace`) and resolve a trace of ``workload``; every
    problem is an InputError. The file's events are checked first, then its tasks resolved in order."""
    path = str(path)
    check_replayed_workload(workload.spec, workload.path)
    spec = parse_trace(read_yaml(path), path, workload.spec)
    arrivals = [Arrival(t, 0.0, (workload.path, f"tasks[{k}]")) for k, t in enumerate(workload.tasks)]
    for add in spec.adds:
        task = _resolve_added(workload, resolve_data_paths(add.spec, Path(path).parent), path, add.where)
        arrivals.append(Arrival(task, add.at_s, (path, add.where)))
    return Trace(path=path, workload=workload, arrivals=tuple(arrivals), cancels=spec.cancels)
