"""Each task's update of each step of a window, started as soon as the task's backwards are done.

The update ``U(s, a)`` of task ``a`` after step ``s`` (``costmodel.schedule``, "Exactness"):

1. sum ``a``'s adapter gradients over the holders of each piece (``GradSync.all_reduce``);
2. this rank's share of ``||g_a||^2`` (``GradSync.squared_norms``: owned pieces only);
3. one all-reduce over every rank of ``[Σ ℓ_i / N_a, ||g_a||^2]``: the task's loss and squared
   global gradient norm, the same numbers on every rank;
4. clip by that norm and step ``a``'s optimizer, or drop the gradients when either number is not
   finite (every rank sees the same numbers, so every rank skips alike).

Steps 1-3 are collectives. They run on one worker thread per rank, key after key in the window's one
global order ``(s, a)``, on process groups no other thread uses (the holder-set groups and a world
group of their own), so they overlap the pipeline's forwards and backwards of other tasks and never
interleave with its point-to-point messages. A key is submitted once this rank has run every
backward of step ``s`` that holds ``a`` (at once for a rank with none); submitting it first applies
the task's previous update, whose gradients would otherwise be summed again. Step 4 runs on the main
thread (:meth:`TaskUpdates.apply`), before the first forward that reads the adapter again, or at the
window's end: a forward never reads an adapter that misses an update, and never races one.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lorafleet.executor.torch.grad_sync import GradSync

Key = tuple[int, int]
"""``(position of the step in the window, task)``."""
UPDATE = "U"
"""An optimizer step in a rank's op log (``TorchExecutor.op_log``)."""


@dataclass(frozen=True)
class UpdateOutcome:
    """What every rank learnt from one task's update."""

    loss: float
    """``Σ ℓ_i / N_a`` over the fleet: the task's mean token loss of the step."""
    squared_norm: float
    """``||g_a||^2`` of the summed gradient, before clipping."""
    finished_s: float
    """When this rank's collectives of the update ended, seconds from the window's start."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.squared_norm)


class TaskUpdates:
    """One window's updates on one rank: submitted in order, summed on a worker thread, applied here.

    Args:
        keys: every update of the window, in the global order (the same on every rank).
        grad_sync: this rank's side of the gradient sum.
        group: a process group of every rank, used by the worker thread only (None in a world of one).
        n_tasks: tasks of the run.
        step: ``step(key, outcome)`` clips and steps (or skips) the task's optimizer on this rank.
        losses: ``losses(key)``, this rank's partial loss of the key's step and task (read when the
            key is submitted, after its last forward here).
        start: the window's start (``time.perf_counter()``).
    """

    def __init__(
        self,
        keys: Sequence[Key],
        grad_sync: GradSync,
        group: dist.ProcessGroup | None,
        n_tasks: int,
        step: Callable[[Key, UpdateOutcome], None],
        losses: Callable[[Key], float],
        start: float,
    ) -> None:
        self.keys = list(keys)
        self.grad_sync, self.group, self.n_tasks = grad_sync, group, n_tasks
        self._step, self._losses, self._start = step, losses, start
        self._queue: queue.SimpleQueue[tuple[Key, float, Future[UpdateOutcome]] | None] = queue.SimpleQueue()
        # A daemon thread: a rank that fails mid-window must still be able to exit while its
        # worker waits in a collective its peers will never join.
        self._thread = threading.Thread(target=self._work, name="lorafleet-updates", daemon=True)
        self._thread.start()
        self._futures: dict[Key, Future[UpdateOutcome]] = {}
        self._next = 0
        """Keys before this index are submitted."""
        self._unapplied: dict[int, Key] = {}
        """Task -> its submitted update not applied yet."""
        self.outcomes: dict[Key, UpdateOutcome] = {}

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            key, loss, future = item
            try:
                future.set_result(self._reduce(key, loss))
            except BaseException as err:  # handed to the main thread, raised by apply()
                future.set_exception(err)

    def _reduce(self, key: Key, loss: float) -> UpdateOutcome:
        task = key[1]
        self.grad_sync.all_reduce([task])
        squared = float(self.grad_sync.squared_norms(self.n_tasks, [task])[task])
        stats = torch.tensor([loss, squared], dtype=torch.float64)
        if self.group is not None:  # None: a world of one rank
            dist.all_reduce(stats, group=self.group)
        return UpdateOutcome(float(stats[0]), float(stats[1]), time.perf_counter() - self._start)

    def submit_while(self, ready: Callable[[Key], bool]) -> None:
        """Submits the next keys in order for as long as ``ready(key)`` says this rank is done with them."""
        while self._next < len(self.keys) and ready(self.keys[self._next]):
            key = self.keys[self._next]
            if key[1] in self._unapplied:
                self.apply(key[1])
            self._futures[key] = future = Future()
            self._queue.put((key, self._losses(key), future))
            self._unapplied[key[1]] = key
            self._next += 1

    def submitted(self, key: Key) -> bool:
        """Whether every key up to ``key`` (in the global order) has been submitted."""
        return self._next >= len(self.keys) or self.keys[self._next] > key

    def apply(self, task: int) -> None:
        """Steps ``task``'s optimizer by its submitted update, if one is pending (waits for its sums)."""
        key = self._unapplied.pop(task, None)
        if key is not None:
            outcome = self._futures.pop(key).result()
            self.outcomes[key] = outcome
            self._step(key, outcome)

    def finish(self) -> dict[Key, UpdateOutcome]:
        """Submits and applies every remaining update (the window's end); returns every outcome."""
        try:
            self.submit_while(lambda key: True)
            for task in sorted(self._unapplied, key=lambda t: self._unapplied[t]):
                self.apply(task)
        finally:
            self._queue.put(None)
        self._thread.join()
        return self.outcomes
