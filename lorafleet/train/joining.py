"""Tasks the queue adds, their data prepared: read, tokenized and checked against the running fleet
(:func:`joining_data`) from the moment the request is first read. Its data is tokenized once (the work counter
``tokenizations``): its slot, its lengths and its placement check use it; a sweep's members share one preparation.

A small add's data (under :data:`BESIDE_BYTES`) is prepared there and then, as the request is read, and the task joins
at its ``at_step``. A large add's is prepared in a thread, beside the steps, and the task joins at the first window
boundary at or after its ``at_step`` where that is done: a large add never holds the fleet at a boundary (#38: a
39 MiB file stalled every rank for 277 s while rank 0 tokenized it there). The step it joins at is then the time
its data took, and the ledger's: a resume replays the same run. No torch here.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafleet.train.live import changed_workload, log
from lorafleet.train.queue import Action, Request
from lorafleet.workload import length_histogram

if TYPE_CHECKING:
    from lorafleet.runtime.data_stream import TaskData
    from lorafleet.specs.workload import TaskSpec
    from lorafleet.train.running import Running


BESIDE_BYTES = 8 << 20
"""A task's data of this many bytes or more (its file, or its saved dataset's files) is prepared beside the steps: at
a few MB/s of tokenization, what would hold the fleet at a boundary for a second or more."""


class Joining:
    """The data of the tasks the queue accepted, by task name, until they join (module doc)."""

    def __init__(self, tokenizer: Any, beside_bytes: int = BESIDE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.beside_bytes = beside_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, tuple[TaskSpec, Future[TaskData]]] = {}
        self.announced: set[str] = set()
        """Tasks whose wait for their data the log has said (once a preparation)."""

    def start(self, task: TaskSpec, running: Running) -> None:
        """``task``'s data prepared: now when small (its problem raised, InputError or ValueError), else beside the
        steps (module doc); once: a task asked for again as it was keeps its first preparation, an edited request
        starts again."""
        known = self._futures.get(task.name)
        if known is not None and known[0] == task:
            return
        sibling = self._sibling(task)
        if sibling is not None:  # a sweep's member: its sweep's data, prepared once
            self._futures[task.name] = (task, sibling)
            return
        if _data_bytes(task) < self.beside_bytes:
            done: Future[TaskData] = Future()
            done.set_result(joining_data(task, running, self.tokenizer))
            self._futures[task.name] = (task, done)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafleet-joining")
        context = contextvars.copy_context()  # the caller's work counters count the preparation too
        future = self._pool.submit(context.run, joining_data, task, running, self.tokenizer)
        self._futures[task.name] = (task, future)
        self.announced.discard(task.name)

    def _sibling(self, task: TaskSpec) -> Future[TaskData] | None:
        """The preparation of another member of ``task``'s sweep (the same data: ``specs.sweep``), if any."""
        if task.member_of is None:
            return None
        return next((f for t, f in self._futures.values() if t.member_of is not None and t.seed_name == task.seed_name),
                    None)  # fmt: skip

    def ready(self, name: str) -> bool:
        """Whether the task's data is prepared (or its preparation failed), or was never asked for."""
        known = self._futures.get(name)
        return known is None or known[1].done()

    def problem(self, name: str) -> str | None:
        """Why the task cannot join (its preparation's error, one line), once it is done; None otherwise."""
        known = self._futures.get(name)
        if known is None or not known[1].done():
            return None
        error = known[1].exception()
        if error is not None:
            self._futures.pop(name)
        return None if error is None else str(error)

    def ready_requests(
        self, requests: list[Request], step: int, reject: Callable[[Request, str], None]
    ) -> list[Request]:
        """The due ``requests`` that can be applied at the boundary before ``step``: an add whose data is still being
        prepared waits (its file stays in the queue, read again at the next boundary), and so does every request
        after it naming its task; an add whose data has a problem is ``reject``-ed with its reason."""
        out, waiting = [], set()
        for request in requests:
            if request.name in waiting:
                continue
            problem = self.problem(request.name) if request.action is Action.ADD else None
            if problem is not None:
                reject(request, problem)
            elif request.action is Action.ADD and not self.ready(request.name):
                waiting.add(request.name)
                if request.name not in self.announced:
                    self.announced.add(request.name)
                    log(f"step {step}: {request.name}'s data is being prepared beside the steps: it joins once it is")
            else:
                out.append(request)
        return out

    def lengths(self) -> dict[str, dict[int, int]]:
        """The token-length histograms of the tasks whose data is prepared, by name."""
        return {n: length_histogram(f.result().raw_lengths) for n, (_, f) in self._futures.items() if _ok(f)}

    def take(self, name: str) -> TaskData | None:
        """The task's prepared data, handed over (waited for when still being prepared); None when never asked for."""
        known = self._futures.pop(name, None)
        if known is None:
            return None
        data = known[1].result()
        return data if data.name == name else replace(data, name=name)  # a sweep's member: its sweep's data

    def wait(self) -> None:
        """Every preparation started so far finished (tests; a stop)."""
        for _, future in self._futures.values():
            future.exception()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _ok(future: Future) -> bool:
    return future.done() and future.exception() is None


def _data_bytes(task: TaskSpec) -> int:
    """The bytes of ``task``'s data: its file's, or the files' of its saved dataset (0 when it cannot be read: its
    preparation says why)."""
    path = Path(task.data.path) if task.data is not None else None
    try:
        if path is None:
            return 0
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    except OSError:
        return 0


def joining_data(task: TaskSpec, running: Running, tokenizer: Any) -> TaskData:
    """A task to add, checked against its data, not its declaration: its data tokenized as training will (once: its
    lengths and its slot use it), lengths it declares (``lengths: {values: ...}``) no shorter than its data's longest
    sequence after its overflow rule, and that sequence held to the configs of the running fleet's GPUs; InputError
    or ValueError (the reason, for the queue's rejection) otherwise."""
    from lorafleet.planner.candidates import valid_candidates
    from lorafleet.runtime.data_stream import prepare_task_data

    data = prepare_task_data(task, tokenizer, task.data.path if task.data else "queue")
    known = {task.name: length_histogram(data.raw_lengths)}
    resolved = changed_workload(running.workload, (task,), known).tasks[0]
    longest = max(len(e) for e in data.examples)  # what it trains on (its overflow rule applied), not a declaration
    if resolved.lengths.max_length < longest:
        raise ValueError(
            f"its lengths declare sequences of at most {resolved.lengths.max_length} tokens, but its data has one of "
            f"{longest} (at context_length {task.context_length}): drop lengths to plan by its data, or lower "
            "context_length"
        )
    cluster = running.plan.fleet()
    largest = max((c.max_tokens for c in valid_candidates(running.cost_model, cluster)), default=0)
    if longest > largest:
        raise ValueError(
            f"its {longest}-token sequences fit no config of {cluster.describe()} "
            f"(at most {largest} tokens a micro-batch); lower context_length"
        )
    return data
