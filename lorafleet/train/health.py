"""Each task's health over a run, from its step reports: :class:`TaskHealth` counts non-finite updates (the
executor skips them: ``nonfinite_tasks``) in a row, stops a task after ``nonfinite_patience`` of them, and
warns about a task whose adapter never moved after its warm-up (``unmoved_tasks``).

A stopped task takes no more batches from the step its stop reaches (``DataStreams.retire``); its adapter
stays at its last finite update. The stopped tasks are part of the run's state: they travel in every
checkpoint (:meth:`TaskHealth.state_dict`) and are stopped again, silently, on resume.

Why an object of its own (as the recalibrator is one): it is the loop's one piece of per-task state that
is not the executor's, and it is checkpointed with the run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

from lorafleet.plans import StepReport


def _warn(message: str) -> None:
    print(f"lorafleet train: {message}", file=sys.stderr, flush=True)


class TaskHealth:
    """The non-finite watch of one launch's tasks (module docstring)."""

    def __init__(self, names: Sequence[str], patience: int, window: int, retire: Callable[[int, int], None]) -> None:
        """``names``: the run's tasks, in task order; ``patience``: non-finite updates in a row that stop a task;
        ``window``: steps a window runs (the rest of one and the next one's plans may be drawn already: a stop
        takes effect after them); ``retire(task, from_step)``: leaves task ``task`` out from ``from_step`` on."""
        self.names = list(names)
        self.patience = patience
        self.window = window
        self._retire = retire
        self.streak = dict.fromkeys(self.names, 0)
        """Task -> its non-finite updates in a row, up to the last step watched."""
        self.stopped: dict[str, int] = {}
        """Task -> the first step it was left out of (``patience`` non-finite updates in a row)."""

    def watch(self, report: StepReport) -> None:
        """One step's report: count its non-finite updates, stop a task at its ``patience``-th in a row, and
        warn about a task whose adapter has not moved."""
        for name in report.losses:
            self.streak[name] = self.streak[name] + 1 if name in report.nonfinite_tasks else 0
        for name in report.nonfinite_tasks:
            streak = self.streak[name]
            _warn(
                f"step {report.step}: task {name!r} has a non-finite loss or gradient; its update "
                f"is skipped ({streak} in a row)"
            )
            if streak >= self.patience and name not in self.stopped:
                # The rest of this window and the next window's plans may be drawn already (look-ahead).
                self.stop(name, report.step + 1 + 2 * self.window)
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

    def state_dict(self) -> dict[str, int]:
        """The stopped tasks, for a checkpoint: task -> the first step it was left out of."""
        return dict(self.stopped)

    def load_state_dict(self, stopped: Mapping[str, int]) -> None:
        """A checkpoint's stopped tasks, stopped again without a word."""
        for name, step in stopped.items():
            self.stop(name, int(step), announce=False)
