"""Step reports on the console while a run trains: :class:`ProgressBar` (rich, on a terminal) or
:class:`LogLines` (a flushed line per step, when stdout is a file or a pipe), both with an ETA
(:func:`format_eta`). Both are writers (``write(report, **extra)``, ``close()``,
:class:`~lorafleet.metrics.sinks.MetricsWriter`).
"""

from __future__ import annotations

import math

import numpy as np

from lorafleet.metrics.records import tokens_per_s
from lorafleet.plans import StepReport


def format_eta(seconds: float) -> str:
    """``4m05s`` under an hour, ``2h07m`` from there (``--`` when unknown)."""
    if not math.isfinite(seconds):
        return "--"
    total = max(int(round(seconds)), 0)
    if total >= 3600:
        hours, minutes = divmod(total // 60, 60)
        return f"{hours}h{minutes:02d}m"
    minutes, secs = divmod(total, 60)
    return f"{minutes}m{secs:02d}s"


def eval_line(extra: dict[str, object]) -> str:
    """A step's evaluation on the console (its row's ``eval_loss`` and ``eval_token_accuracy``, ``train.evaluation``):
    ``eval chat 1.92 (acc 0.41) docsum 2.30 (acc 0.35)``; empty when the step was followed by none."""
    losses, accuracy = extra.get("eval_loss"), extra.get("eval_token_accuracy")
    if not isinstance(losses, dict) or not isinstance(accuracy, dict):
        return ""
    return "eval " + " ".join(f"{t} {v:.4g} (acc {accuracy[t]:.3f})" for t, v in losses.items())


class _Eta:
    """The time left to step ``total``: the mean measured step time of the steps seen so far (this
    launch) times the steps left after the latest one. Computed from the reports, not from the wall
    clock between them, so it is right at the first report and when reports arrive a pipeline window
    at a time (where rich's ``TimeRemainingColumn``, which needs two updates less than 30 s apart,
    shows nothing)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._times: list[float] = []

    def after(self, report: StepReport) -> float:
        self._times.append(report.makespan_s)
        return float(np.mean(self._times)) * max(self.total - report.step - 1, 0)


class ProgressBar:
    """A rich progress bar over steps ``start..total`` with an ETA: step k/K, the step's measured and
    predicted time, mean loss over tasks, tokens/s, ``ETA 1m18s`` (:class:`_Eta`, as :class:`LogLines`)."""

    def __init__(self, total: int, start: int = 0, console: object | None = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._eta = _Eta(total)
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"),
            TextColumn("{task.fields[stats]}"),
            console=console,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, stats="", eta="ETA --")
        self._progress.start()

    def write(self, report: StepReport, **extra: object) -> None:
        losses = list(report.losses.values())
        loss = f"loss {np.mean(losses):.4f}  " if losses else ""
        stats = (
            f"step {report.makespan_s:.2f}s (predicted {report.estimated_makespan_s:.2f}s)  {loss}"
            f"{tokens_per_s(report, extra):,.0f} tok/s"
        )
        eta = f"ETA {format_eta(self._eta.after(report))}"
        self._progress.update(self._task, completed=report.step + 1, stats=stats, eta=eta)
        line = eval_line(extra)
        if line:
            self._progress.console.print(f"step {report.step + 1}  {line}")

    def close(self) -> None:
        self._progress.stop()


class LogLines:
    """One line per step on stdout, printed and flushed as the step's report arrives, for runs whose
    output is a file or a pipe (nohup, Slurm, a pod's log)::

        step 3/10  loss docsum 2.41 chat 1.97  2,113 tok/s  step 11.2 s (predicted 10.9 s)  ETA 1m18s

    The prediction is the dispatcher's estimate of the step (``estimated_makespan_s``); the ETA
    is the mean measured step time of this run times the steps left (:class:`_Eta`). Reports arrive
    a pipeline window at a time (``policy.pipeline_window``): the window's lines come together.
    """

    def __init__(self, total: int, print_fn=None) -> None:
        self.total = total
        self._print = print_fn or (lambda line: print(line, flush=True))
        self._eta = _Eta(total)

    def write(self, report: StepReport, **extra: object) -> None:
        eta = self._eta.after(report)
        losses = "  loss " + " ".join(f"{t} {v:.3g}" for t, v in report.losses.items()) if report.losses else ""
        self._print(
            f"step {report.step + 1}/{self.total}{losses}  {tokens_per_s(report, extra):,.0f} tok/s  "
            f"step {report.makespan_s:.3g} s (predicted {report.estimated_makespan_s:.3g} s)  "
            f"ETA {format_eta(eta)}"
        )
        line = eval_line(extra)
        if line:
            self._print(f"step {report.step + 1}/{self.total}  {line}")

    def close(self) -> None:
        pass
