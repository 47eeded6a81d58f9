"""What a step's metrics hold: one :class:`~lorafleet.plans.StepReport` plus the caller's ``extra``, as a JSON
object (``metrics.jsonl``), a flat row (``metrics.csv``) and scalars by tag (TensorBoard, W&B, MLflow).

``extra`` carries what the report does not: ``tokens_per_s``, ``predicted_busy_s`` (the dispatcher's busy
time per replica, as recalibrated), ``model_busy_s`` (the cost model's own), ``replica_tokens``,
``correction`` (each replica's recalibration factor) and ``task_gpu_s`` (GPU-seconds each task owes for
the step, ``lorafleet.accounting.task_gpu_seconds``).

A JSONL row (:func:`json_record`) is the report's fields (``step``, ``replica_busy_s``, ``makespan_s``,
``task_tokens``, ``task_padding_tokens``, ``losses``, ``estimated_makespan_s``, ``dispatch_solve_s``,
``failed_replicas``, ``rank_cpu_s``, ``nonfinite_tasks``, ``unmoved_tasks``, and each updated task's ``task_lr``,
``task_grad_norm`` and ``task_epoch``), its derived ``replica_idle_s``
and ``utilisation``, and every ``extra`` key as given (a mapping stays one JSON object).
:func:`step_report` reads the report back out of such a row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from lorafleet.plans import StepReport

EVAL_MAPPINGS = ("eval_loss", "eval_token_accuracy", "eval_gpu_s")
"""``extra`` mappings (task -> value) of a step an evaluation followed; their scalars' tags are ``<key>/<task>``."""
MAPPING_COLUMNS = {"task_gpu_s": "gpu_s"}
"""``extra`` mappings whose columns are named other than ``<key>/<name>``."""


def tokens_per_s(report: StepReport, extra: Mapping[str, object]) -> float:
    """``extra["tokens_per_s"]`` when given, else the report's real tokens over its makespan (0 without one)."""
    if "tokens_per_s" in extra:
        return float(extra["tokens_per_s"])  # type: ignore[arg-type]
    tokens = sum(report.task_tokens.values())
    return tokens / report.makespan_s if report.makespan_s > 0 else 0.0


def _ratio(measured: float, predicted: float) -> float:
    """Measured over predicted (> 1: the cost model was optimistic); nan without a prediction."""
    return measured / predicted if predicted > 0 else math.nan


def json_record(report: StepReport, **extra: object) -> dict[str, object]:
    """One report as its ``metrics.jsonl`` object (module docstring); a mapping in ``extra`` (``task_gpu_s``)
    stays one JSON object under its key, as ``task_tokens`` does."""
    extra = {k: dict(v) if isinstance(v, Mapping) else v for k, v in extra.items()}
    return asdict(report) | {"replica_idle_s": report.replica_idle_s, "utilisation": report.utilisation} | extra


_REPORT_FIELDS = tuple(f.name for f in fields(StepReport))
_TASK_SERIES = {"lr": "task_lr", "grad_norm": "task_grad_norm", "epoch": "task_epoch"}
"""Per-task values of a report by the tag (and CSV column) prefix they are logged under: ``lr/<task>``, ..."""


def step_report(row: Mapping[str, Any]) -> StepReport:
    """The StepReport a :func:`json_record` row was written from (its lists as tuples; the other keys ignored)."""
    values = {name: row[name] for name in _REPORT_FIELDS if name in row}
    return StepReport(**{name: tuple(v) if isinstance(v, list) else v for name, v in values.items()})


def flat_record(report: StepReport, **extra: object) -> dict[str, object]:
    """One report as a flat row: scalars, then ``loss/<task>``, ``tokens/<task>``, ``padding/<task>``,
    ``lr/<task>``, ``grad_norm/<task>``, ``epoch/<task>``, ``busy_s/<replica>``, ``idle_s/<replica>`` and
    ``cpu_s/rank_<i>``. An ``extra`` sequence (one value per replica: ``predicted_busy_s``, ``correction``,
    ``replica_tokens``) becomes ``<key>/<replica>`` columns; an ``extra`` mapping becomes ``<key>/<name>`` columns,
    ``task_gpu_s`` (GPU-seconds per task) the ``gpu_s/<task>`` columns; other ``extra`` values are kept as they are."""
    extra = dict(extra)
    row: dict[str, object] = {
        "step": report.step,
        "makespan_s": report.makespan_s,
        "estimated_makespan_s": report.estimated_makespan_s,
        "makespan_ratio": _ratio(report.makespan_s, report.estimated_makespan_s),
        "dispatch_solve_s": report.dispatch_solve_s,
        "utilisation": report.utilisation,
        "tokens": sum(report.task_tokens.values()),
        "tokens_per_s": tokens_per_s(report, extra),
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
    for key, mapping in _TASK_SERIES.items():
        row.update({f"{key}/{task}": value for task, value in getattr(report, mapping).items()})
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


def step_scalars(report: StepReport, **extra: object) -> dict[str, float]:
    """The scalars of one step report, by tag, as :class:`~lorafleet.metrics.sinks.TensorBoardWriter` (and the
    W&B and MLflow loggers) log them: see :class:`~lorafleet.metrics.sinks.TensorBoardWriter` for the tags."""
    out: dict[str, float] = {}
    for task, loss in report.losses.items():
        out[f"loss/{task}"] = loss
    for key, mapping in _TASK_SERIES.items():
        out.update({f"{key}/{task}": value for task, value in getattr(report, mapping).items()})
    out["throughput/tokens_per_s"] = tokens_per_s(report, extra)
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
    for key in EVAL_MAPPINGS:  # a step an evaluation followed (``train.evaluation``)
        for task, value in dict(extra.get(key, {}) or {}).items():  # type: ignore[call-overload]
            out[f"{key}/{task}"] = value
    for key, tag in (("eval_s", "eval/seconds"), ("eval_predicted_s", "eval/predicted_s")):
        if key in extra:
            out[tag] = extra[key]  # type: ignore[assignment]
    return {tag: float(value) for tag, value in out.items()}
