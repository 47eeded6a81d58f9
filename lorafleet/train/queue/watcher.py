"""Rank 0's reading of the queue: each request file judged against the run, at every window boundary.

:func:`read_request` turns a file into a :class:`~lorafleet.train.queue.requests.Request`, or says in one
line why it cannot be applied (a RequestError); :func:`read_requests`, an add of a task with a ``sweep`` into an
add of each of its members, applied or rejected together. :class:`QueueWatcher` polls the directory: a malformed
request is *rejected* (one line in the run's log, the file moved to ``rejected/`` beside
``<file>.reason``, the run goes on); the valid ones that are due (``at_step`` reached) are *accepted*
(moved to ``accepted/``) and returned, to be applied together at that boundary; a request whose
``at_step`` is still ahead waits, and the run ends a window at that step.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError
from lorafleet.specs._base import FieldError
from lorafleet.specs.io import write_text_atomic
from lorafleet.specs.sweep import sweep_members
from lorafleet.specs.workload import TaskSpec, deep_merge, resolve_data_paths
from lorafleet.train.queue.ledger import Ledger
from lorafleet.train.queue.requests import (
    ACCEPTED,
    PRIVATE_DIR,
    PRIVATE_FILE,
    REJECTED,
    Action,
    AddRequestFile,
    Request,
    RequestError,
    StopRequestFile,
    UpdateRequestFile,
    check_reach,
    read_request_file,
    reason_file,
    request_files,
    updated_task,
    validated,
)


def read_requests(
    path: Path, defaults: Mapping[str, Any], ledger: Ledger, data_roots: Sequence[str] | None = None
) -> list[Request]:
    """A request file's requests: :func:`read_request`'s one, or an add of a task with a ``sweep``: an add of each
    of its members (``specs.sweep``), all in one file, accepted or rejected together; RequestError."""
    action, raw = read_request_file(path)
    if action is not Action.ADD or raw.get("sweep") is None:
        return [read_request(path, defaults, ledger, data_roots)]
    merged = deep_merge(dict(defaults), raw)
    try:
        members = sweep_members({k: v for k, v in merged.items() if k not in ("action", "at_step")})
    except FieldError as err:
        raise RequestError(f"{'.'.join(map(str, err.loc))}: {err}") from None
    if raw["name"] in ledger.names():
        raise RequestError(f"task {raw['name']!r} is already in this run (a sweep's name names its adapter)")
    keys = {k: raw[k] for k in ("action", "at_step") if k in raw}
    return [_add(path, {**member, **keys}, ledger, data_roots) for member in members]


def read_request(
    path: Path, defaults: Mapping[str, Any], ledger: Ledger, data_roots: Sequence[str] | None = None
) -> Request:
    """A request file, validated against the run's ``ledger`` (``defaults``: the workload's) and, a task to add,
    its data against ``data_roots`` (``requests.check_reach``; None: anywhere); RequestError."""
    action, raw = read_request_file(path)
    name = raw["name"]
    if action is Action.ADD:
        return _add(path, deep_merge(dict(defaults), raw), ledger, data_roots)
    if action is Action.UPDATE:
        update = validated(UpdateRequestFile, raw)
        request = Request(path.name, action, name, update.at_step, changes=update.changes())
    else:
        request = Request(path.name, action, name, validated(StopRequestFile, raw).at_step)
    check_against(request, ledger)
    return request


def _add(path: Path, raw: Mapping[str, Any], ledger: Ledger, data_roots: Sequence[str] | None) -> Request:
    """An add request (``raw``: over the defaults), validated as :func:`read_request` says."""
    name = raw["name"]
    add = validated(AddRequestFile, raw)
    if add.data is None:
        raise RequestError("data: training needs data (a JSONL file or a saved dataset)")
    task = resolve_data_paths(add.task(), path.parent)
    check_reach(task, data_roots)
    at = add.at_step
    if "start_step" in raw:  # the step it asked to start at: the one it joins at
        if "at_step" in raw and add.at_step != task.start_step:
            raise RequestError(f"start_step {task.start_step} and at_step {add.at_step} disagree: give one")
        at = task.start_step
    request = Request(path.name, Action.ADD, name, at, task=task)
    check_against(request, ledger)
    return request


def check_against(request: Request, ledger: Ledger) -> None:
    """RequestError when ``request`` cannot apply to the run's tasks as ``ledger`` has them: an add of a name the
    run has had, another action on a task that is not active, an update that makes its task invalid. Judged
    when the file is read and again when it is due (the requests before it may have changed the tasks)."""
    name = request.name
    if request.action is Action.ADD:
        if name in ledger.names():
            raise RequestError(f"task {name!r} is already in this run (task names name their adapters)")
        return
    active = {t.name: t for t in ledger.active}
    if name not in active:
        raise RequestError(f"no active task {name!r} in this run (active: {', '.join(sorted(active)) or 'none'})")
    if request.action is Action.UPDATE:
        updated_task(active[name], request.changes)


class QueueWatcher:
    """Rank 0's view of the queue directory (module doc)."""

    def __init__(
        self,
        directory: str | Path,
        defaults: Mapping[str, Any],
        ledger: Ledger,
        check: Callable[[TaskSpec], None] | None = None,
        log: Callable[[str], None] | None = None,
        data_roots: Sequence[str] | None = None,
        taken: Callable[[str, int], int] | None = None,
    ) -> None:
        """``check`` vets a task to add beyond its schema (its data tokenizes): raises InputError or ValueError;
        ``data_roots``: the folders a task's data must resolve inside (None: anywhere), checked first; ``taken(task,
        step)``: the batches a running task took before ``step`` (a new deadline is held to what is left)."""
        self.directory = Path(directory)
        self.data_roots = None if data_roots is None else tuple(data_roots)
        self.defaults = dict(defaults)
        self.ledger = ledger
        self.check = check
        self.taken = taken
        self.log = log or (lambda line: print(f"lorafleet train: queue: {line}", file=sys.stderr, flush=True))
        self.waiting: dict[str, tuple[tuple[int, int], list[Request]]] = {}
        """Valid requests whose ``at_step`` is still ahead, by file (a sweep's file holds several), with the file's
        (mtime, size) when read."""

    def poll(self, step: int, accept: bool = True) -> list[Request]:
        """The requests due at the boundary before ``step``; malformed ones are rejected. Requests later in the list
        see the ones before them (an add then an update of the same task). With ``accept``, the due ones are moved
        to ``accepted/`` at once; else the caller moves them (:meth:`accept`) once it has recorded them
        (``train.changes`` writes the change's pending file first, so that a crash in between loses none).

        A waiting request is read again when its file changed (an edit is never ignored) and judged again when it
        comes due, against the tasks as the requests before it left them. Of one boundary's requests, a task
        that joins there cannot leave there too (it has trained no step): that finish or cancel is rejected."""
        due: list[Request] = []
        ledger = self.ledger
        joining: set[str] = set()
        for path in request_files(self.directory):
            try:
                stamp = _stamp(path)
            except FileNotFoundError:  # taken away since it was listed
                continue
            waiting = self.waiting.get(path.name)
            fresh = waiting is None or waiting[0] != stamp
            try:
                requests = read_requests(path, self.defaults, ledger, self.data_roots) if fresh else waiting[1]
                adds = [r.task for r in requests if r.task is not None]
                if self.check is not None and fresh:  # a sweep's members: their data prepared once (train.joining)
                    try:
                        for task in adds:
                            self.check(task)
                    except (InputError, ValueError) as err:
                        raise RequestError(str(err)) from None
            except RequestError as err:
                self.reject(path, str(err))
                continue
            at_step = requests[0].at_step
            if waiting is not None and fresh:
                self.log(f"read {path.name} again: it changed while it waited for step {waiting[1][0].at_step}")
            if at_step > step:
                self.waiting[path.name] = (stamp, requests)
                continue
            self.waiting.pop(path.name, None)
            try:
                checked = ledger
                for request in requests:
                    self._check_due(request, checked, step, joining)
                    checked = checked.apply([request], step)
            except RequestError as err:
                self.reject(path, str(err))
                continue
            joining.update(r.name for r in requests if r.action is Action.ADD)
            due += requests
            ledger = checked
        if accept:
            self.accept(due)
        return due

    def _check_due(self, request: Request, ledger: Ledger, step: int, joining: set[str]) -> None:
        """RequestError when ``request``, due at the boundary before ``step``, cannot apply to the tasks as ``ledger``
        has them there (``joining``: the tasks that join at this boundary)."""
        check_against(request, ledger)
        if (
            request.task is not None
            and "start_step" in request.task.model_fields_set
            and request.task.start_step < step
        ):
            raise RequestError(
                f"start_step {request.task.start_step} has passed: the run is at step {step} (drop start_step "
                "to join at the next boundary, or ask for a later one)"
            )
        if request.task is not None:  # a deadline is checked against the step the task starts at
            validated(TaskSpec, {**request.task.model_dump(), "start_step": step})
        if request.action is Action.UPDATE and request.changes.get("deadline") is not None:
            self._check_deadline(request, ledger, step)
        if request.action in (Action.FINISH, Action.CANCEL) and request.name in joining:
            raise RequestError(
                f"task {request.name!r} joins at this step (step {step}): it cannot leave at the same step; "
                "ask again for a later step"
            )

    def _check_deadline(self, request: Request, ledger: Ledger, step: int) -> None:
        """RequestError when an update's deadline cannot be met from the boundary before ``step``: a task takes at
        most one batch a step, so its steps left (``taken``) end no sooner than ``step`` plus their number (as a
        new task's deadline is held to its start step plus its steps)."""
        deadline = int(request.changes["deadline"])
        spec = next(t for t in ledger.active if t.name == request.name)
        if deadline < step:
            raise RequestError(f"deadline {deadline} has passed: the run is at step {step}")
        if spec.steps is None or self.taken is None:
            return
        left = spec.steps - self.taken(request.name, step)
        if step + left > deadline:
            raise RequestError(
                f"deadline {deadline} cannot be met: {request.name} has {left} of its {spec.steps} steps left at step "
                f"{step}, one a step at most, so step {step + left} at the earliest"
            )

    def accept(self, requests: Sequence[Request]) -> None:
        """``requests``' files moved to ``accepted/`` (those still in the queue directory: applying a recorded change
        again moves what a crash left)."""
        for request in requests:
            path = self.directory / request.file
            if path.is_file():
                _move(path, self.directory / ACCEPTED)

    def next_due(self) -> int | None:
        """The earliest ``at_step`` of the requests waiting."""
        return min((rs[0].at_step for _, rs in self.waiting.values()), default=None)

    def reject(self, path: Path, reason: str) -> None:
        """One log line; the file moved to ``rejected/`` with ``<file>.reason``."""
        reason = " ".join(reason.split())
        self.log(f"rejected {path.name}: {reason}")
        target = _move(path, self.directory / REJECTED)
        write_text_atomic(reason_file(target), reason + "\n", mode=PRIVATE_FILE)
        self.waiting.pop(path.name, None)


def _stamp(path: Path) -> tuple[int, int]:
    """What tells an edited file from the one read: its modification time (ns) and size."""
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def _move(path: Path, directory: Path) -> Path:
    directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    target = directory / path.name
    if target.exists():
        stem, n = target.stem, 1
        while (target := directory / f"{stem}-{n}{path.suffix}").exists():
            n += 1
    shutil.move(str(path), target)
    return target
