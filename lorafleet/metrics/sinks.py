"""Where step reports go in a run directory: :class:`JsonlWriter` (``metrics.jsonl``), :class:`CsvWriter`
(``metrics.csv``), :class:`TensorBoardWriter` (scalars under a log directory), and :class:`FanOut` (several
writers at once: these, the console's and the trackers').

Every writer has the :class:`MetricsWriter` interface, ``write(report, **extra)`` and ``close()``; what a
record holds is :mod:`lorafleet.metrics.records`'s.
"""

from __future__ import annotations

import csv
import io
import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from lorafleet.errors import full_disk
from lorafleet.metrics.records import flat_record, json_record, step_scalars
from lorafleet.plans import StepReport
from lorafleet.specs.io import write_text_atomic


class MetricsWriter(Protocol):
    """Anything that takes step reports: the interface every writer here has."""

    def write(self, report: StepReport, **extra: object) -> None: ...

    def close(self) -> None: ...


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
        """The report's :func:`~lorafleet.metrics.records.json_record`, keys sorted."""
        self._file.write(json.dumps(json_record(report, **extra), sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _extended_header(header: Sequence[str], row: Mapping[str, object]) -> list[str]:
    """``header`` with the keys of ``row`` it lacks: each after the last column of its family (the
    part before ``/``: ``gpu_s/new`` goes after the last ``gpu_s/...``), or at the end."""
    columns = list(header)
    for key in row:
        if key in columns:
            continue
        family = key.split("/", 1)[0] + "/" if "/" in key else None
        at = max((i for i, c in enumerate(columns) if family and c.startswith(family)), default=len(columns) - 1)
        columns.insert(at + 1, key)
    return columns


class CsvWriter(ClosingWriter):
    """The JSONL's twin as a table: one flat row per step report (:func:`~lorafleet.metrics.records.flat_record`),
    flushed per row.

    The columns are those of the first row written (or, when appending to an existing file, its
    header), extended when a later row brings a column they lack (a task that joins the run, a
    ``task_gpu_s`` first given at a resume): the file is rewritten once with the new column beside
    its family (``gpu_s/<task>`` after the other ``gpu_s/`` columns), atomically
    (``specs.io.write_text_atomic``), the earlier rows' value for it empty. A missing value is empty.
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
        elif any(key not in self._writer.fieldnames for key in row):
            self._extend(_extended_header(self._writer.fieldnames, row))
        self._writer.writerow(row)
        self._file.flush()

    def _extend(self, columns: list[str]) -> None:
        """Rewrite the file under ``columns`` (earlier rows empty in the new ones) and append from there."""
        self._file.close()
        with self.path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=columns, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        write_text_atomic(self.path, table.getvalue())
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=columns, restval="", extrasaction="ignore")

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter(ClosingWriter):
    """Scalars per step under ``log_dir`` (``torch.utils.tensorboard``; needs the ``tensorboard`` package).

    Tags (:func:`~lorafleet.metrics.records.step_scalars`): ``loss/<task>``, ``lr/<task>``, ``grad_norm/<task>``,
    ``epoch/<task>``, ``throughput/tokens_per_s``,
    ``makespan/measured_s``, ``makespan/estimated_s``, ``makespan/measured_over_estimated``, ``dispatch/solve_s``,
    ``utilisation``, ``busy/replica_<i>`` and, given ``predicted_busy_s``, ``busy_predicted/replica_<i>`` and
    ``busy_ratio/replica_<i>`` (measured over predicted), given ``correction``, ``correction/replica_<i>``, given
    ``task_gpu_s``, ``gpu_s/<task>`` (GPU-seconds the task owes for the step), ``cpu_s/total``, and after an
    evaluation ``eval_loss/<task>``, ``eval_token_accuracy/<task>``, ``eval_gpu_s/<task>``, ``eval/seconds`` and
    ``eval/predicted_s``. Ratios are left out where the prediction is zero.
    """

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        """``purge_step``: events at this step or later, left by a run this one resumes, are discarded."""
        from torch.utils.tensorboard import SummaryWriter  # torch stays out of this module's import

        _quiet_full_disk_in_writer_threads()
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step or None)

    def write(self, report: StepReport, **extra: object) -> None:
        for tag, value in step_scalars(report, **extra).items():
            self._writer.add_scalar(tag, value, report.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _quiet_full_disk_in_writer_threads() -> None:
    """A full disk in TensorBoard's writer thread is not printed as that thread's traceback (``threading.excepthook``,
    installed once): the thread keeps the error, and the writer's next ``add_scalar`` or ``flush`` raises it on the
    writing thread, where a run says it as its one line (``train.failures``). Any other thread's error, and any
    other error of that thread, goes to the hook that was there before."""
    previous = threading.excepthook
    if getattr(previous, "quiet_full_disk", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        writer_thread = type(args.thread).__module__.startswith("tensorboard.")
        if writer_thread and args.exc_value is not None and full_disk(args.exc_value) is not None:
            return
        previous(args)

    hook.quiet_full_disk = True  # type: ignore[attr-defined]
    threading.excepthook = hook


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
