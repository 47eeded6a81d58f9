"""The lines a training run ends with: where its files are, its mean step time measured against predicted, each
replica's recalibration, each tenant's GPU-seconds (its evaluations' included; a sweep's members summed as one
tenant), its evaluations, its sweeps, and the tasks stopped for non-finite updates::

    lorafleet train: 10 steps; adapters in out/adapters, metrics in out/metrics.jsonl (and .csv, tensorboard/)
      step time: measured 1.234 s, predicted 1.200 s (x1.03, mean over 10 steps; cost model analytic:A100-40GB)
      recalibrated: replica 0 x1.02 (10 steps), replica 1 x0.99 (10 steps)
      GPU-seconds by task (the whole run): docsum 12.3 (60 %), chat 8.2 (40 %)
      of which evaluation: docsum 0.61, chat 0.24
      eval docsum: best 1.912 (step 40), last 1.912 (step 40)
      eval chat: best 2.31 (step 20), last 2.36 (step 30); stopped early at step 30, 70 of its steps not taken

The figures are the run's :class:`~lorafleet.metrics.RunSummary`, built from every launch's rows of
``metrics.jsonl`` (across restarts and resumes); this module only formats them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from lorafleet.metrics import RunSummary, read_rows, sum_task_gpu_seconds, summarize_rows
from lorafleet.rundir import RunDir

if TYPE_CHECKING:
    from lorafleet.dispatch import ReplicaCalibration
    from lorafleet.sweep_report import SweepResult
    from lorafleet.train.evaluation import TaskEvaluations


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
    evaluations: Mapping[str, TaskEvaluations] | None = None,
    sweeps: Sequence[SweepResult] = (),
) -> str:
    """The closing lines (module docstring) of the run in ``run_dir`` after ``steps`` steps. ``recalibration``: each
    replica's factor, or None for no line (recalibration off, or no step ran in this launch); ``evaluations``: the
    tasks' (``train.evaluation``), a line each; ``sweeps``: the run's sweeps (``lorafleet.sweep_report``), a line
    each."""
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
    tenant = {m.name: sweep.name for sweep in sweeps for m in sweep.members}  # a sweep is one tenant
    evaluated = tenants(sum_task_gpu_seconds(row.get("eval_gpu_s", {}) for row in read_rows(run_dir.metrics_jsonl)),
                        tenant)  # fmt: skip
    owed = sum_task_gpu_seconds([tenants(summary.task_gpu_seconds, tenant), evaluated])
    if owed:
        total = sum(owed.values()) or 1.0
        shares = ", ".join(f"{name} {s:.4g} ({100 * s / total:.0f} %)" for name, s in owed.items())
        lines.append(f"  GPU-seconds by task (the whole run): {shares}")
    if evaluated:
        lines.append("  of which evaluation: " + ", ".join(f"{name} {s:.4g}" for name, s in evaluated.items()))
    lines += [f"  {line}" for line in evaluation_lines(evaluations or {})]
    lines += [f"  {sweep_line(sweep)}" for sweep in sweeps]
    stopped = list(stopped)
    if stopped:
        lines.append(f"  stopped tasks (non-finite updates): {', '.join(stopped)}")
    return "\n".join(lines)


def tenants(gpu_s: Mapping[str, float], tenant: Mapping[str, str]) -> dict[str, float]:
    """GPU-seconds by task summed by tenant: a sweep's members under their sweep's name, other tasks as they are."""
    return sum_task_gpu_seconds({tenant.get(name, name): s} for name, s in gpu_s.items())


def sweep_line(sweep: SweepResult) -> str:
    """A sweep's line: its winner and the adapter promoted, the members dropped, and its GPU-seconds (one
    tenant)."""
    dropped = sum(m.dropped_rung is not None for m in sweep.members)
    line = f"sweep {sweep.name}: {len(sweep.members)} members ({dropped} dropped at rungs), {sweep.gpu_s:.4g} GPU-s; "
    if sweep.winner is None:
        return line + "no winner (no member was evaluated)"
    best = sweep.member(sweep.winner).best_loss
    return line + f"winner {sweep.winner} (best eval loss {best:.4g}), its adapter in adapters/{sweep.name}"


def evaluation_lines(evaluations: Mapping[str, TaskEvaluations]) -> list[str]:
    """A line per evaluated task: its best and last eval loss, and where early stopping stopped it, with the steps it
    did not take (what it is not charged for)."""
    lines = []
    for name, task in evaluations.items():
        if not task.history:
            continue
        best, (last_step, last_loss, _) = task.stopping, task.history[-1]
        line = (
            f"eval {name}: best {best.best_loss:.4g} (step {best.best_step}), last {last_loss:.4g} (step {last_step})"
        )
        if task.dropped_rung is not None:
            line += f"; dropped at rung {task.dropped_rung} (step {task.stopped_at}), {task.steps_not_taken} of its "
            line += "steps not taken"
        elif task.stopped_at is not None:
            line += f"; stopped early at step {task.stopped_at}, {task.steps_not_taken} of its steps not taken"
        lines.append(line)
    return lines
