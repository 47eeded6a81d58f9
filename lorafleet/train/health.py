"""Each task's health over a run, from its step reports: :class:`TaskHealth` counts non-finite updates (the
executor skips them: ``nonfinite_tasks``) in a row, stops a task after ``nonfinite_patience`` of them, and
warns about a task whose adapter never moved after its warm-up (``unmoved_tasks``).

A stopped task takes no more batches from the first step whose plan had not been started when the
report of its ``patience``-th non-finite update in a row arrived (``LookaheadDispatcher.started_until``:
with windows of one step, the step after next); its adapter stays at its last finite update. The stopped
tasks are part of the run's state: they travel in every checkpoint (:meth:`TaskHealth.state_dict`), the
resume check draws the data cursors with them, and they are stopped again, silently, on resume.

Why an object of its own (as the recalibrator is one): it is the loop's one piece of per-task state that
is not the executor's, and it is checkpointed with the run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lorafleet.plans import StepReport
from lorafleet.runtime.checkpoint_files import STOPPED_TASKS, stopped_tasks

NONFINITE_STREAKS = "nonfinite_streaks"
"""The key of a checkpoint's ``extra`` under which each task's non-finite updates in a row are recorded."""


def _warn(message: str) -> None:
    print(f"lorafleet train: {message}", file=sys.stderr, flush=True)


class TaskHealth:
    """The non-finite watch of one launch's tasks (module docstring)."""

    def __init__(self, names: Sequence[str], patience: int, retire: Callable[[int, int], None]) -> None:
        """``names``: the run's tasks, in task order; ``patience``: non-finite updates in a row that stop a task;
        ``retire(task, from_step)``: leaves task ``task`` out from ``from_step`` on."""
        self.names = list(names)
        self.patience = patience
        self._retire = retire
        self.streak = dict.fromkeys(self.names, 0)
        """Task -> its non-finite updates in a row, up to the last step watched."""
        self.stopped: dict[str, int] = {}
        """Task -> the first step it was left out of (``patience`` non-finite updates in a row)."""

    def watch(self, report: StepReport, undrawn: int) -> None:
        """One step's report: count its non-finite updates, stop a task at its ``patience``-th in a row (from
        step ``undrawn``, the first whose plan is not under way), and warn about a task whose adapter has not
        moved."""
        for name in report.losses:
            self.streak[name] = self.streak[name] + 1 if name in report.nonfinite_tasks else 0
        for name in report.nonfinite_tasks:
            streak = self.streak[name]
            _warn(
                f"step {report.step}: task {name!r} has a non-finite loss or gradient; its update "
                f"is skipped ({streak} in a row)"
            )
            if streak >= self.patience and name not in self.stopped:
                self.stop(name, undrawn)
        for name in report.unmoved_tasks:
            _warn(
                f"warning: task {name!r}: its adapter has not moved after its warm-up; check its "
                "learning rate, alpha and grad_clip"
            )

    def stop(self, name: str, from_step: int, announce: bool = True) -> None:
        """Leave task ``name`` out from step ``from_step`` on (nothing when the run no longer has it)."""
        if name not in self.names:
            return  # stopped, then finished or cancelled through the queue
        self.stopped[name] = from_step
        self._retire(self.names.index(name), from_step)
        if announce:
            _warn(
                f"task {name!r} stopped after {self.patience} non-finite steps "
                "in a row; its adapter stays at its last finite update"
            )

    def retask(self, names: Sequence[str]) -> None:
        """The run's tasks changed at a boundary (queued changes): a task that stays keeps its streak, a new one
        starts at 0; the stopped tasks stay recorded (they are part of the data's cursors)."""
        self.names = list(names)
        self.streak = {name: self.streak.get(name, 0) for name in self.names}

    def state_dict(self) -> dict[str, dict[str, int]]:
        """For a checkpoint's ``extra``: the stopped tasks (task -> the first step it was left out of) and each
        task's non-finite updates in a row, so that a resumed run stops a task where the uninterrupted one does."""
        return {STOPPED_TASKS: dict(self.stopped), NONFINITE_STREAKS: {n: k for n, k in self.streak.items() if k}}

    def load_state_dict(self, extra: Mapping[str, Any]) -> None:
        """A checkpoint's ``extra``: its stopped tasks stopped again without a word, its streaks carried on."""
        for name, step in stopped_tasks(extra).items():
            self.stop(name, step, announce=False)
        for name, streak in extra.get(NONFINITE_STREAKS, {}).items():
            if name in self.streak:
                self.streak[name] = int(streak)
