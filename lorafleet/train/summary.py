"""The lines a training run ends with: where its files are, its mean step time measured against predicted, each
replica's recalibration, each task's GPU-seconds, and the tasks stopped for non-finite updates::

    lorafleet train: 10 steps; adapters in out/adapters, metrics in out/metrics.jsonl (and .csv, tensorboard/)
      step time: measured 1.234 s, predicted 1.200 s (x1.03, mean over 10 steps; cost model analytic:A100-40GB)
      recalibrated: replica 0 x1.02 (10 steps), replica 1 x0.99 (10 steps)
      GPU-seconds by task (the whole run): docsum 12.3 (60 %), chat 8.2 (40 %)

The figures are the run's :class:`~lorafleet.metrics.RunSummary`, built from every launch's rows of
``metrics.jsonl`` (across restarts and resumes); this module only formats them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from lorafleet.metrics import RunSummary, read_rows, summarize_rows
from lorafleet.rundir import RunDir

if TYPE_CHECKING:
    from lorafleet.dispatch import ReplicaCalibration


def run_summary(run_dir: RunDir) -> RunSummary:
    """The summary of the run in ``run_dir``: its whole ``metrics.jsonl``, every launch's steps."""
    return summarize_rows(read_rows(run_dir.metrics_jsonl))


def summary_text(
    run_dir: RunDir,
    steps: int,
    summary: RunSummary,
    *,
    cost_source: str,
    recalibration: Sequence[ReplicaCalibration] | None,
    stopped: Iterable[str],
) -> str:
    """The closing lines (module docstring) of the run in ``run_dir`` after ``steps`` steps. ``recalibration``: each
    replica's factor, or None for no line (recalibration off, or no step ran in this launch)."""
    from lorafleet.dispatch import summarize_factors

    lines = [
        f"lorafleet train: {steps} steps; adapters in {run_dir.adapters}, metrics in "
        f"{run_dir.metrics_jsonl} (and .csv, tensorboard/)"
    ]
    if summary.steps:
        measured, predicted = summary.mean_makespan_s, summary.mean_estimated_makespan_s
        lines.append(
            f"  step time: measured {measured:.3f} s, predicted {predicted:.3f} s "
            f"(x{measured / predicted:.2f}, mean over {summary.steps} steps; cost model {cost_source})"
        )
    if recalibration is not None:
        lines.append(f"  recalibrated: {summarize_factors(recalibration)}")
    owed = summary.task_gpu_seconds
    if owed:
        total = sum(owed.values()) or 1.0
        shares = ", ".join(f"{name} {s:.4g} ({100 * s / total:.0f} %)" for name, s in owed.items())
        lines.append(f"  GPU-seconds by task (the whole run): {shares}")
    stopped = list(stopped)
    if stopped:
        lines.append(f"  stopped tasks (non-finite updates): {', '.join(stopped)}")
    return "\n".join(lines)
