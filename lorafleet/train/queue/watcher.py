"""Rank 0's reading of the queue: each request file judged against the run, at every window boundary.

:func:`read_request` turns a file into a :class:`~lorafleet.train.queue.requests.Request`, or says in one
line why it cannot be applied (a RequestError). :class:`QueueWatcher` polls the directory: a malformed
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
from lorafleet.specs.io import write_text_atomic
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
    validated,
)


def read_request(
    path: Path, defaults: Mapping[str, Any], ledger: Ledger, data_roots: Sequence[str] | None = None
) -> Request:
    """A request file, validated against the run's ``ledger`` (``defaults``: the workload's) and, a task to add,
    its data against ``data_roots`` (``requests.check_reach``; None: anywhere); RequestError."""
    action, raw = read_request_file(path)
    name = raw["name"]
    if action is Action.ADD:
        add = validated(AddRequestFile, deep_merge(dict(defaults), raw))
        if add.data is None:
            raise RequestError("data: training needs data (a JSONL file or a saved dataset)")
        task = resolve_data_paths(add.task(), path.parent)
        if data_roots is not None:
            check_reach(task, data_roots)
        request = Request(path.name, action, name, add.at_step, task=task)
    elif action is Action.UPDATE:
        update = validated(UpdateRequestFile, raw)
        request = Request(path.name, action, name, update.at_step, changes=update.changes())
    else:
        request = Request(path.name, action, name, validated(StopRequestFile, raw).at_step)
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
        validated(TaskSpec, {**active[name].model_dump(), **request.changes})


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
    ) -> None:
        """``check`` vets a task to add beyond its schema (its data tokenizes): raises InputError or ValueError;
        ``data_roots``: the folders a task's data must resolve inside (None: anywhere), checked first."""
        self.directory = Path(directory)
        self.data_roots = None if data_roots is None else tuple(data_roots)
        self.defaults = dict(defaults)
        self.ledger = ledger
        self.check = check
        self.log = log or (lambda line: print(f"lorafleet train: queue: {line}", file=sys.stderr, flush=True))
        self.waiting: dict[str, Request] = {}
        """Valid requests whose ``at_step`` is still ahead, by file."""

    def poll(self, step: int) -> list[Request]:
        """The requests due at the boundary before ``step`` (moved to ``accepted/``); malformed ones are rejected.
        Requests later in the list see the ones before them (an add then an update of the same task)."""
        due: list[Request] = []
        ledger = self.ledger
        for path in request_files(self.directory):
            try:
                request = self.waiting.get(path.name) or read_request(path, self.defaults, ledger, self.data_roots)
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
            waited = self.waiting.pop(path.name, None) is not None
            try:
                if waited:
                    check_against(request, ledger)
                if request.task is not None:  # a deadline is checked against the step the task starts at
                    validated(TaskSpec, {**request.task.model_dump(), "start_step": step})
            except RequestError as err:
                self.reject(path, str(err))
                continue
            due.append(request)
            ledger = ledger.apply([request], step)
        for request in due:
            _move(self.directory / request.file, self.directory / ACCEPTED)
        return due

    def next_due(self) -> int | None:
        """The earliest ``at_step`` of the requests waiting."""
        return min((r.at_step for r in self.waiting.values()), default=None)

    def reject(self, path: Path, reason: str) -> None:
        """One log line; the file moved to ``rejected/`` with ``<file>.reason``."""
        reason = " ".join(reason.split())
        self.log(f"rejected {path.name}: {reason}")
        target = _move(path, self.directory / REJECTED)
        write_text_atomic(reason_file(target), reason + "\n", mode=PRIVATE_FILE)
        self.waiting.pop(path.name, None)


def _move(path: Path, directory: Path) -> Path:
    directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    target = directory / path.name
    if target.exists():
        stem, n = target.stem, 1
        while (target := directory / f"{stem}-{n}{path.suffix}").exists():
            n += 1
    shutil.move(str(path), target)
    return target
