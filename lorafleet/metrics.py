"""Step reports to files and to the run's summary: makespan, GPU-seconds, utilisation, padding.

Writers share one interface, ``write(report, **extra)`` and ``close()``: :class:`JsonlWriter`
(``metrics.jsonl``), :class:`CsvWriter` (``metrics.csv``, one flat row per step),
:class:`TensorBoardWriter` (scalars under a log directory), :class:`WandbWriter` and
:class:`MlflowWriter` (the same scalars to Weights & Biases or MLflow, ``--logger``; optional packages,
imported when built), :class:`ProgressBar` (rich, on the console), :class:`LogLines` (a line per step,
when stdout is not a terminal) and :class:`FanOut` (several of them at once). ``extra`` carries what the report does
not: ``tokens_per_s``, ``predicted_busy_s`` (the cost model's busy time per replica) and
``task_gpu_s`` (GPU-seconds each task owes for the step, ``lorafleet.accounting.task_gpu_seconds``:
columns and scalars ``gpu_s/<task>``).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
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
    task_gpu_seconds: dict[str, float] = field(default_factory=dict)
    """Σ_steps of each task's GPU-seconds (``task_gpu_s`` given to :func:`summarize`; empty without)."""

    @property
    def mean_utilisation(self) -> float:
        return float(np.mean(self.replica_utilisation)) if self.replica_utilisation else 0.0


def summarize(reports: Sequence[StepReport], n_gpus: int, task_gpu_s: Sequence[Mapping[str, float]] = ()) -> RunSummary:
    """Fold step reports of one deployment with ``n_gpus`` allocated GPUs into a RunSummary.

    ``task_gpu_s``: per step, what each task owes (``lorafleet.accounting.task_gpu_seconds``), the
    same steps as ``reports`` or none; their per-task sums are ``RunSummary.task_gpu_seconds``
    (tasks in the order first seen)."""
    if not reports:
        raise ValueError("no step reports to summarise")
    if task_gpu_s and len(task_gpu_s) != len(reports):
        raise ValueError(f"task GPU-seconds for {len(task_gpu_s)} steps, {len(reports)} step reports")
    totals: dict[str, float] = {}
    for step in task_gpu_s:
        for task, seconds in step.items():
            totals[task] = totals.get(task, 0.0) + float(seconds)
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
        task_gpu_seconds=totals,
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
        """A mapping in ``extra`` (``task_gpu_s``) stays one JSON object under its key, as ``task_tokens`` does."""
        extra = {k: dict(v) if isinstance(v, Mapping) else v for k, v in extra.items()}
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


#: ``extra`` mappings whose columns are named other than ``<key>/<name>``.
MAPPING_COLUMNS = {"task_gpu_s": "gpu_s"}


def flat_record(report: StepReport, **extra: object) -> dict[str, object]:
    """One report as a flat row: scalars, then ``loss/<task>``, ``tokens/<task>``, ``padding/<task>``,
    ``busy_s/<replica>``, ``idle_s/<replica>`` and ``cpu_s/rank_<i>``. An ``extra`` sequence (one value per
    replica: ``predicted_busy_s``, ``correction``, ``replica_tokens``) becomes ``<key>/<replica>`` columns;
    an ``extra`` mapping becomes ``<key>/<name>`` columns, ``task_gpu_s`` (GPU-seconds per task) the
    ``gpu_s/<task>`` columns; other ``extra`` values are kept as they are."""
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
        elif isinstance(value, Mapping):  # one value per task: a column each
            prefix = MAPPING_COLUMNS.get(key, key)
            row.update({f"{prefix}/{name}": v for name, v in value.items()})
        else:
            row[key] = value
    return row


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
    """The JSONL's twin as a table: one flat row per step report (:func:`flat_record`), flushed per row.

    The columns are those of the first row written (or, when appending to an existing file, its
    header), extended when a later row brings a column they lack (a task that joins the run, a
    ``task_gpu_s`` first given at a resume): the file is rewritten once with the new column beside
    its family (``gpu_s/<task>`` after the other ``gpu_s/`` columns), atomically (a temporary file,
    then renamed), the earlier rows' value for it empty. A missing value is empty.
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
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=columns, restval="", extrasaction="ignore")

    def close(self) -> None:
        self._file.close()


def step_scalars(report: StepReport, **extra: object) -> dict[str, float]:
    """The scalars of one step report, by tag, as :class:`TensorBoardWriter` (and the W&B and MLflow
    loggers) log them: see :class:`TensorBoardWriter` for the tags."""
    out: dict[str, float] = {}
    for task, loss in report.losses.items():
        out[f"loss/{task}"] = loss
    out["throughput/tokens_per_s"] = _tokens_per_s(report, extra)
    out["makespan/measured_s"] = report.makespan_s
    out["makespan/estimated_s"] = report.estimated_makespan_s
    if report.estimated_makespan_s > 0:
        out["makespan/measured_over_estimated"] = _ratio(report.makespan_s, report.estimated_makespan_s)
    out["dispatch/solve_s"] = report.dispatch_solve_s
    out["utilisation"] = report.utilisation
    for i, busy in enumerate(report.replica_busy_s):
        out[f"busy/replica_{i}"] = busy
    predicted = tuple(extra.get("predicted_busy_s", ()) or ())  # type: ignore[arg-type]
    for i, (busy, pred) in enumerate(zip(report.replica_busy_s, predicted)):
        out[f"busy_predicted/replica_{i}"] = pred
        if pred > 0:
            out[f"busy_ratio/replica_{i}"] = _ratio(busy, pred)
    for i, factor in enumerate(tuple(extra.get("correction", ()) or ())):  # type: ignore[arg-type]
        out[f"correction/replica_{i}"] = factor
    for task, seconds in dict(extra.get("task_gpu_s", {}) or {}).items():  # type: ignore[call-overload]
        out[f"gpu_s/{task}"] = seconds
    if report.rank_cpu_s:
        out["cpu_s/total"] = sum(report.rank_cpu_s)
    return {tag: float(value) for tag, value in out.items()}


class TensorBoardWriter(ClosingWriter):
    """Scalars per step under ``log_dir`` (``torch.utils.tensorboard``; needs the ``tensorboard`` package).

    Tags: ``loss/<task>``, ``throughput/tokens_per_s``, ``makespan/measured_s``, ``makespan/estimated_s``,
    ``makespan/measured_over_estimated``, ``dispatch/solve_s``, ``utilisation``, ``busy/replica_<i>``
    and, given ``predicted_busy_s``, ``busy_predicted/replica_<i>`` and ``busy_ratio/replica_<i>``
    (measured over predicted), given ``correction``, ``correction/replica_<i>``, given ``task_gpu_s``,
    ``gpu_s/<task>`` (GPU-seconds the task owes for the step), and ``cpu_s/total``.
    Ratios are left out where the prediction is zero.
    """

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        """``purge_step``: events at this step or later, left by a run this one resumes, are discarded."""
        from torch.utils.tensorboard import SummaryWriter  # torch stays out of this module's import

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step or None)

    def write(self, report: StepReport, **extra: object) -> None:
        for tag, value in step_scalars(report, **extra).items():
            self._writer.add_scalar(tag, value, report.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


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
            f"{_tokens_per_s(report, extra):,.0f} tok/s"
        )
        eta = f"ETA {format_eta(self._eta.after(report))}"
        self._progress.update(self._task, completed=report.step + 1, stats=stats, eta=eta)

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
            f"step {report.step + 1}/{self.total}{losses}  {_tokens_per_s(report, extra):,.0f} tok/s  "
            f"step {report.makespan_s:.3g} s (predicted {report.estimated_makespan_s:.3g} s)  "
            f"ETA {format_eta(eta)}"
        )

    def close(self) -> None:
        pass


class TrackerWriter(ClosingWriter):
    """The step scalars (:func:`step_scalars`, TensorBoard's tags) to an experiment tracker's run, named after
    the run directory ``out``, ``config`` its parameters. A launch that ``resume``s the run (a ``--resume``, a
    restart, a queued change) continues the tracker run the first launch started, its id kept in
    ``<out>/<ID_FILE>``; a fresh launch starts a new one."""

    ID_FILE = ""
    PACKAGE = ""
    """The package the writer imports when built (``pip install 'lorafleet[<logger>]'``)."""

    def __init__(
        self,
        out: str | Path,
        run_name: str | None = None,
        config: Mapping[str, object] | None = None,
        resume: bool = False,
    ) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        id_file = out / self.ID_FILE
        previous = id_file.read_text(encoding="utf-8").strip() or None if resume and id_file.is_file() else None
        self.run_id = self._start(out, previous, run_name or out.resolve().name, dict(config or {}))
        id_file.write_text(self.run_id + "\n", encoding="utf-8")

    def _start(self, out: Path, run_id: str | None, name: str, config: dict[str, object]) -> str:
        """Continue the tracker run ``run_id`` (None: start one called ``name``); its id."""
        raise NotImplementedError


class WandbWriter(TrackerWriter):
    """A Weights & Biases run (:class:`TrackerWriter`): project ``lorafleet`` (or ``WANDB_PROJECT``), files under
    ``WANDB_DIR`` (default the run directory). ``WANDB_MODE`` (``offline``, ``disabled``) and W&B's other
    variables apply as usual. W&B's console capture is off unless ``WANDB_CONSOLE`` says otherwise: the step
    lines stay the process's own."""

    ID_FILE = ".wandb-run-id"
    PACKAGE = "wandb"

    def _start(self, out: Path, run_id: str | None, name: str, config: dict[str, object]) -> str:
        import wandb  # lazily: an optional dependency (the ``wandb`` extra)

        directory = Path(os.environ.get("WANDB_DIR") or out)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "lorafleet",
            name=name,
            dir=str(directory),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(console=os.environ.get("WANDB_CONSOLE") or "off"),
        )
        return self.run.id

    def write(self, report: StepReport, **extra: object) -> None:
        self.run.log(step_scalars(report, **extra), step=report.step)

    def close(self) -> None:
        self.run.finish()


def _mlflow_key(tag: str) -> str:
    """An MLflow metric name: letters, digits and ``_-. /`` only."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in tag)


class MlflowWriter(TrackerWriter):
    """An MLflow run (:class:`TrackerWriter`): tracking URI ``MLFLOW_TRACKING_URI``, else a file store under
    ``<out>/mlruns``; experiment ``lorafleet`` (or ``MLFLOW_EXPERIMENT_NAME``)."""

    ID_FILE = ".mlflow-run-id"
    PACKAGE = "mlflow"

    def _start(self, out: Path, run_id: str | None, name: str, config: dict[str, object]) -> str:
        from mlflow.tracking import MlflowClient  # lazily: an optional dependency (the ``mlflow`` extra)

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lorafleet"
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        for key, value in config.items():
            self.client.log_param(run_id, _mlflow_key(key), str(value)[:6000])
        return run_id

    def write(self, report: StepReport, **extra: object) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, report.step) for k, v in step_scalars(report, **extra).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


LOGGERS: dict[str, type[TrackerWriter]] = {"wandb": WandbWriter, "mlflow": MlflowWriter}
"""``--logger`` name -> its writer (whose ``PACKAGE`` the ``lorafleet[<name>]`` extra installs)."""


def experiment_logger(
    name: str, out: str | Path, config: Mapping[str, object] | None = None, resume: bool = False
) -> ClosingWriter:
    """The ``--logger`` writer called ``name`` (a key of :data:`LOGGERS`) for the run directory ``out``."""
    return LOGGERS[name](out, config=config, resume=resume)


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
