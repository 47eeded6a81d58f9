"""Step reports to files and to the run's summary: makespan, GPU-seconds, utilisation, padding.

Writers share one interface, ``write(report, **extra)`` and ``close()``: :class:`JsonlWriter`
(``metrics.jsonl``), :class:`CsvWriter` (``metrics.csv``, one flat row per step),
:class:`TensorBoardWriter` (scalars under a log directory), :class:`ProgressBar` (rich, on the
console) and :class:`FanOut` (several of them at once). ``extra`` carries what the report does
not: ``tokens_per_s`` and ``predicted_busy_s`` (the cost model's busy time per replica).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from lorafleet.plans import StepReport


@dataclass(frozen=True)
class RunSummary:
    """Aggregates over the steps of one run on one deployment."""

    steps: int
    mean_makespan_s: float
    p95_makespan_s: float
    gpu_seconds: float
    """Σ_steps makespan * allocated GPUs: every GPU is held for the whole step."""
    replica_utilisation: tuple[float, ...]
    """Busy time over wall time, per replica, over the whole run."""
    padding_ratio: float
    """Padding tokens over occupied tokens."""
    tokens: int
    """Real tokens processed."""
    failures: int

    @property
    def mean_utilisation(self) -> float:
        return float(np.mean(self.replica_utilisation)) if self.replica_utilisation else 0.0


def summarize(reports: Sequence[StepReport], n_gpus: int) -> RunSummary:
    """Fold step reports of one deployment with ``n_gpus`` allocated GPUs into a RunSummary."""
    if not reports:
        raise ValueError("no step reports to summarise")
    makespans = np.array([r.makespan_s for r in reports])
    busy = np.array([r.replica_busy_s for r in reports])  # (steps, replicas)
    tokens = sum(sum(r.task_tokens.values()) for r in reports)
    padding = sum(sum(r.task_padding_tokens.values()) for r in reports)
    return RunSummary(
        steps=len(reports),
        mean_makespan_s=float(makespans.mean()),
        p95_makespan_s=float(np.percentile(makespans, 95)),
        gpu_seconds=float(makespans.sum() * n_gpus),
        replica_utilisation=tuple(float(u) for u in busy.sum(axis=0) / makespans.sum()),
        padding_ratio=padding / (tokens + padding) if tokens + padding else 0.0,
        tokens=int(tokens),
        failures=sum(len(r.failed_replicas) for r in reports),
    )


class ClosingWriter:
    """``with`` support for writers: ``__exit__`` calls the subclass's ``close``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> ClosingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonlWriter(ClosingWriter):
    """Appends one JSON object per step report to ``path`` (flushed per line, so a crash loses at most one)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, report: StepReport, **extra: object) -> None:
        record = asdict(report) | {"replica_idle_s": report.replica_idle_s, "utilisation": report.utilisation} | extra
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MetricsWriter(Protocol):
    """Anything that takes step reports: the interface every writer here has."""

    def write(self, report: StepReport, **extra: object) -> None: ...

    def close(self) -> None: ...


def _tokens_per_s(report: StepReport, extra: dict[str, object]) -> float:
    if "tokens_per_s" in extra:
        return float(extra["tokens_per_s"])  # type: ignore[arg-type]
    tokens = sum(report.task_tokens.values())
    return tokens / report.makespan_s if report.makespan_s > 0 else 0.0


def _ratio(measured: float, predicted: float) -> float:
    """Measured over predicted (> 1: the cost model was optimistic); nan without a prediction."""
    return measured / predicted if predicted > 0 else math.nan


def flat_record(report: StepReport, **extra: object) -> dict[str, object]:
    """One report as a flat row: scalars, then ``loss/<task>``, ``tokens/<task>``, ``padding/<task>``,
    ``busy_s/<replica>``, ``idle_s/<replica>`` and ``cpu_s/rank_<i>``. An ``extra`` sequence (one value per
    replica: ``predicted_busy_s``, ``correction``, ``replica_tokens``) becomes ``<key>/<replica>`` columns;
    other ``extra`` values are kept as they are."""
    extra = dict(extra)
    row: dict[str, object] = {
        "step": report.step,
        "makespan_s": report.makespan_s,
        "estimated_makespan_s": report.estimated_makespan_s,
        "makespan_ratio": _ratio(report.makespan_s, report.estimated_makespan_s),
        "dispatch_solve_s": report.dispatch_solve_s,
        "utilisation": report.utilisation,
        "tokens": sum(report.task_tokens.values()),
        "tokens_per_s": _tokens_per_s(report, extra),
        "failed_replicas": " ".join(str(r) for r in report.failed_replicas),
        "nonfinite_tasks": " ".join(report.nonfinite_tasks),
    }
    extra.pop("tokens_per_s", None)
    for task, loss in report.losses.items():
        row[f"loss/{task}"] = loss
    for task, tokens in report.task_tokens.items():
        row[f"tokens/{task}"] = tokens
    for task, tokens in report.task_padding_tokens.items():
        row[f"padding/{task}"] = tokens
    for i, busy in enumerate(report.replica_busy_s):
        row[f"busy_s/{i}"] = busy
    for i, idle in enumerate(report.replica_idle_s):
        row[f"idle_s/{i}"] = idle
    for i, cpu in enumerate(report.rank_cpu_s):
        row[f"cpu_s/rank_{i}"] = cpu
    for key, value in extra.items():
        if isinstance(value, (list, tuple)):  # one value per replica: a column each
            row.update({f"{key}/{i}": v for i, v in enumerate(value)})
        else:
            row[key] = value
    return row


class CsvWriter(ClosingWriter):
    """The JSONL's twin as a table: one flat row per step report (:func:`flat_record`), flushed per row.

    The columns are those of the first row written (or, when appending to an existing file, its
    header): a task or replica that first appears later has no column, and a missing value is empty.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header: list[str] | None = None
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), None)
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer: csv.DictWriter | None = None
        if header:
            self._writer = csv.DictWriter(self._file, fieldnames=header, restval="", extrasaction="ignore")

    def write(self, report: StepReport, **extra: object) -> None:
        row = flat_record(report, **extra)
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row), restval="", extrasaction="ignore")
            self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter(ClosingWriter):
    """Scalars per step under ``log_dir`` (``torch.utils.tensorboard``; needs the ``tensorboard`` package).

    Tags: ``loss/<task>``, ``throughput/tokens_per_s``, ``makespan/measured_s``, ``makespan/estimated_s``,
    ``makespan/measured_over_estimated``, ``dispatch/solve_s``, ``utilisation``, ``busy/replica_<i>``
    and, given ``predicted_busy_s``, ``busy_predicted/replica_<i>`` and ``busy_ratio/replica_<i>``
    (measured over predicted), given ``correction``, ``correction/replica_<i>``, and ``cpu_s/total``.
    Ratios are left out where the prediction is zero.
    """

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        """``purge_step``: events at this step or later, left by a run this one resumes, are discarded."""
        from torch.utils.tensorboard import SummaryWriter  # torch stays out of this module's import

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step or None)

    def write(self, report: StepReport, **extra: object) -> None:
        step = report.step
        scalar = self._writer.add_scalar
        for task, loss in report.losses.items():
            scalar(f"loss/{task}", loss, step)
        scalar("throughput/tokens_per_s", _tokens_per_s(report, extra), step)
        scalar("makespan/measured_s", report.makespan_s, step)
        scalar("makespan/estimated_s", report.estimated_makespan_s, step)
        if report.estimated_makespan_s > 0:
            scalar("makespan/measured_over_estimated", _ratio(report.makespan_s, report.estimated_makespan_s), step)
        scalar("dispatch/solve_s", report.dispatch_solve_s, step)
        scalar("utilisation", report.utilisation, step)
        for i, busy in enumerate(report.replica_busy_s):
            scalar(f"busy/replica_{i}", busy, step)
        predicted = tuple(extra.get("predicted_busy_s", ()) or ())  # type: ignore[arg-type]
        for i, (busy, pred) in enumerate(zip(report.replica_busy_s, predicted)):
            scalar(f"busy_predicted/replica_{i}", pred, step)
            if pred > 0:
                scalar(f"busy_ratio/replica_{i}", _ratio(busy, pred), step)
        for i, factor in enumerate(tuple(extra.get("correction", ()) or ())):  # type: ignore[arg-type]
            scalar(f"correction/replica_{i}", factor, step)
        if report.rank_cpu_s:
            scalar("cpu_s/total", sum(report.rank_cpu_s), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class ProgressBar:
    """A rich progress bar over steps ``start..total`` with an ETA: step k/K, the step's measured and
    predicted time, mean loss over tasks, tokens/s."""

    def __init__(self, total: int, start: int = 0, console: object | None = None) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            console=console,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, stats="")
        self._progress.start()

    def write(self, report: StepReport, **extra: object) -> None:
        losses = list(report.losses.values())
        loss = f"loss {np.mean(losses):.4f}  " if losses else ""
        stats = (
            f"step {report.makespan_s:.2f}s (predicted {report.estimated_makespan_s:.2f}s)  {loss}"
            f"{_tokens_per_s(report, extra):,.0f} tok/s"
        )
        self._progress.update(self._task, completed=report.step + 1, stats=stats)

    def close(self) -> None:
        self._progress.stop()


class LogLines:
    """One line per step on stdout, for runs whose output is a file (nohup, Slurm, a pod's log)::

        step 3/10  loss docsum 2.41 chat 1.97  2,113 tok/s  step 11.2 s (predicted 10.9 s)  ETA 1m18s

    The prediction is the dispatcher's estimate of the step (``estimated_makespan_s``); the ETA
    is the mean measured step time of this run times the steps left.
    """

    def __init__(self, total: int, print_fn=None) -> None:
        self.total = total
        self._print = print_fn or (lambda line: print(line, flush=True))
        self._times: list[float] = []

    def write(self, report: StepReport, **extra: object) -> None:
        self._times.append(report.makespan_s)
        losses = "  loss " + " ".join(f"{t} {v:.3g}" for t, v in report.losses.items()) if report.losses else ""
        eta = float(np.mean(self._times)) * max(self.total - report.step - 1, 0)
        minutes, seconds = divmod(int(round(eta)), 60)
        self._print(
            f"step {report.step + 1}/{self.total}{losses}  {_tokens_per_s(report, extra):,.0f} tok/s  "
            f"step {report.makespan_s:.3g} s (predicted {report.estimated_makespan_s:.3g} s)  "
            f"ETA {minutes}m{seconds:02d}s"
        )

    def close(self) -> None:
        pass


class FanOut(ClosingWriter):
    """Sends every report to several writers; closes them all (then raises the first error, if any)."""

    def __init__(self, *writers: MetricsWriter) -> None:
        self.writers = writers

    def write(self, report: StepReport, **extra: object) -> None:
        for writer in self.writers:
            writer.write(report, **extra)

    def close(self) -> None:
        error: BaseException | None = None
        for writer in self.writers:
            try:
                writer.close()
            except BaseException as exc:  # close the others first
                error = error or exc
        if error is not None:
            raise error
