"""The incremental re-plan of a change, run beside the training steps instead of at their boundary.

At a boundary where tasks join or leave, the running deployment usually serves the new task set
(``planner.incremental.kept_plan``: every expected sequence fits a replica), and the planner's search, not
the change itself, is most of what the fleet would wait for: 0.1 s on the toy model, 5 CPU s for LobRA's
70B on 64 GPUs, 12 CPU s for 64 tenants on 1,024 GPUs, three quarters of that fleet's step
(``benchmarks/bench_queue.py --replan``). So rank 0 (``train.changes``, by ``planner.decision``'s rule)
applies the change on the kept deployment at once and runs the re-plan (``train.live.replan_change``) in a
thread beside the next steps; the step's own work is in torch's kernels and the collectives, which release
the GIL, and CBC solves in processes of its own. The re-plan's answer is applied at the boundary ``after``
steps later, a fixed step (``--replan-after``): the run does not depend on how fast the planner was, and a
resume in between (``<queue>/.replan.json``) applies the same answer at the same step. When the re-plan is
not done by then, that boundary waits for it (the log says how long).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafleet.planner import Replan

GATE_ENV = "LORAFLEET_REPLAN_GATE"
"""For tests of a fault while a re-plan runs: when set to a path, a re-plan started beside the steps waits for that
path to exist before it solves, so the boundary that applies its answer waits too and the test can act in between
(a deterministic trigger, not a race against the steps). That boundary, as it starts waiting, creates the path with
``.waiting`` appended: the test's cue that the run is held there, the boundary's queue already read."""


@dataclass
class BackgroundReplan:
    """A re-plan for the tasks of boundary ``step`` running in a thread, its answer due at boundary ``at``.

    Not a daemon: a process that ends (a stop, a crash of the loop) waits for it, as the interpreter joins its
    threads before it exits. A daemon thread would be frozen mid-solve there, inside HiGHS's native code, whose
    thread pool the process's exit then tears down: ``terminate called without an active exception``, SIGABRT.
    The fleet changes (``train.changes``) start none whose answer is due after the run's last step."""

    step: int
    at: int
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _answer: Replan | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    @classmethod
    def start(cls, step: int, at: int, replan: Callable[[], Replan]) -> BackgroundReplan:
        """Run ``replan`` in a thread; its answer (or its error) is :meth:`answer`'s."""
        running = cls(step, at)

        gate = os.environ.get(GATE_ENV)

        def work() -> None:
            try:
                while gate and not Path(gate).exists():
                    time.sleep(0.01)
                running._answer = replan()
            except BaseException as err:  # re-raised in the loop's thread by answer(): the run fails there
                running._error = err
            finally:
                running._done.set()

        threading.Thread(target=work, name=f"lorafleet-replan-{step}").start()
        return running

    def answer(self) -> tuple[Replan, float]:
        """The re-plan's answer and the seconds this call waited for it; its error, raised, when it failed."""
        started = time.perf_counter()
        gate = os.environ.get(GATE_ENV)
        if gate and not self._done.is_set():
            Path(f"{gate}.waiting").touch()  # GATE_ENV's cue
        self._done.wait()
        waited = time.perf_counter() - started
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer, waited


class BesideSteps:
    """The one re-plan running beside the steps (the last change's), with its record ``<queue>/.replan.json``
    (``train.queue.pending.PendingReplan``): what a resume in between runs again."""

    def __init__(self, queue_dir: Path) -> None:
        self.queue_dir = queue_dir
        self.running: BackgroundReplan | None = None

    @property
    def at(self) -> int | None:
        """The boundary its answer is due at (None: none runs)."""
        return self.running.at if self.running is not None else None

    def due(self, step: int, end: int) -> bool:
        """Its answer is due at the boundary before ``step`` (before the run's ``end``: else it is never applied)."""
        return self.running is not None and self.running.at == step < end

    def start(self, step: int, at: int, end: int, replan: Callable[[], Replan]) -> bool:
        """``replan``, for the change of boundary ``step``, started, due at ``at`` and recorded; False, and none
        started, when the run ends at ``end`` before ``at`` (its answer would never apply)."""
        from lorafleet.train.queue import PendingReplan, clear_pending_replan, save_pending_replan

        if at >= end:
            clear_pending_replan(self.queue_dir)
            return False
        save_pending_replan(self.queue_dir, PendingReplan(step, at))
        self.running = BackgroundReplan.start(step, at, replan)
        return True

    def supersede(self) -> bool:
        """A change of the tasks at a boundary: the re-plan under way, for the tasks before it, is dropped (True),
        never applied."""
        from lorafleet.train.queue import clear_pending_replan

        superseded, self.running = self.running is not None, None
        if superseded:
            clear_pending_replan(self.queue_dir)
        return superseded

    def take(self) -> BackgroundReplan:
        """The re-plan whose answer is due, no longer under way (its record stays until the answer is settled)."""
        running, self.running = self.running, None
        assert running is not None
        return running
