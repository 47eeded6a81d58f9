"""Simulation reports: PNG plots and one HTML page that shows them beside the tables."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt
import numpy as np

from lorafleet.accounting import SECONDS_PER_HOUR
from lorafleet.eval_replay import TaskEvals
from lorafleet.plans import FrontierPoint
from lorafleet.simulate import ScheduleRun
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.io import write_text_atomic
from lorafleet.workload import Workload

Row = dict[str, object]


def summary_rows(runs: Sequence[ScheduleRun], cluster: ClusterSpec | None = None) -> list[Row]:
    """One row per method (its :attr:`ScheduleRun.summary`): GPUs, mean and p95 step time, GPU-seconds per
    step, utilisation, padding, failures, and the GPU-seconds the first run saves over it; with a ``cluster``
    whose pools all have prices, each method's mean cost per step and the cost the first run saves."""
    ours = runs[0]
    costs = [run.cost_per_step(cluster) for run in runs] if cluster is not None and cluster.priced else []
    rows = []
    for k, run in enumerate(runs):
        summary = run.summary
        gpu_s = summary.mean_gpu_seconds
        row: Row = {
            "method": run.name,
            "gpus": run.gpus,
            "mean_step_s": float(summary.mean_makespan_s),
            "p95_step_s": summary.p95_makespan_s,
            "gpu_s_per_step": gpu_s,
            "utilisation": summary.utilisation,
            "padding_ratio": summary.padding_ratio,
            "failures": summary.failures,
            "saved_by_lorafleet": 1 - ours.summary.mean_gpu_seconds / gpu_s if run is not ours else 0.0,
        }
        if costs and all(c is not None for c in costs):
            cost, first = float(np.mean(costs[k])), float(np.mean(costs[0]))
            row["cost_per_step"] = cost
            row["cost_saved_by_lorafleet"] = 1 - first / cost if run is not ours and cost > 0 else 0.0
        rows.append(row)
    return rows


def pool_rows(run: ScheduleRun, cluster: ClusterSpec) -> list[Row]:
    """One row per pool of ``cluster``: its GPU kind, the GPUs ``run`` holds there, their utilisation (busy
    over held GPU-time), GPU-seconds per step and, where the pool has a price, its cost per step and over
    the run (``ScheduleRun.pool_usage``)."""
    usage = run.pool_usage()
    steps = max(1, len(run.makespan_s))
    rows = []
    for pool in cluster.pools:
        used = usage.get(pool.name)
        held = used.gpu_seconds if used is not None else 0.0
        row: Row = {
            "pool": pool.name or "(one pool)",
            "gpu": pool.gpu,
            "gpus": pool.n_gpus,
            "gpus_held": used.gpus if used is not None else 0,
            "utilisation": used.utilisation if used is not None else 0.0,
            "gpu_s_per_step": held / steps,
        }
        if pool.price_per_gpu_hour is not None:
            row["cost_per_step"] = held * pool.price_per_gpu_hour / SECONDS_PER_HOUR / steps
            row["cost_run"] = held * pool.price_per_gpu_hour / SECONDS_PER_HOUR
        rows.append(row)
    return rows


def task_cost_rows(run: ScheduleRun) -> list[Row]:
    """One row per task of ``run``: real tokens, GPU-seconds over the run (``RunSummary.task_gpu_seconds``:
    each step's cost shared out by the simulated time of the replicas that ran the task), its share
    of the run's GPU-seconds (``"12.3 %"``) and GPU-seconds per 1k real tokens."""
    gpu_s = run.summary.task_gpu_seconds
    tokens = run.summary.task_tokens
    total = sum(gpu_s.values())
    rows = []
    for task in dict.fromkeys([*tokens, *gpu_s]):
        seconds, n = gpu_s.get(task, 0.0), tokens.get(task, 0)
        rows.append(
            {
                "task": task,
                "tokens": n,
                "gpu_s": seconds,
                "share": f"{100 * seconds / total:.1f} %" if total > 0 else "",
                "gpu_s_per_1k_tokens": 1000 * seconds / n if n else math.nan,
            }
        )
    return rows


def eval_rows(evals: Mapping[str, TaskEvals], reference: Mapping[str, TaskEvals] | None = None) -> list[Row]:
    """One row per evaluated task (``simulate`` and ``simulate --arrivals``): its evaluations, their GPU-seconds,
    its best evaluation (the global step count after it, its loss), the step it stopped early at, its steps
    taken and, with ``reference`` (the same run with no early stop), the steps it did not take."""
    rows = []
    for name, e in evals.items():
        best = e.state.best_loss if e.state.best_step is not None else None
        row: Row = {
            "task": name,
            "evals": len(e.records),
            "eval_gpu_s": e.eval_gpu_s,
            "best_step": e.state.best_step if best is not None else "-",
            "best_loss": best if best is not None else "-",
            "stopped_at": e.stop_step if e.stop_step is not None else "-",
            "steps": e.steps,
        }
        if reference is not None:
            row["not_taken"] = reference[name].steps - e.steps
        rows.append(row)
    return rows


def _plot_evals(evals: Mapping[str, TaskEvals], out: Path) -> None:
    """Each evaluated task's loss against its trained tokens, its best circled and its stop crossed."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, e in evals.items():
        points = [(r.tokens / 1e6, r.loss) for r in e.records if r.loss is not None]
        if not points:
            continue
        (line,) = ax.plot(*zip(*points), marker=".", label=name)
        best = next(r for r in e.records if r.step == e.state.best_step)
        ax.plot(best.tokens / 1e6, best.loss, "o", mfc="none", ms=10, color=line.get_color())
        if e.stop_step is not None:
            ax.plot(points[-1][0], points[-1][1], "x", ms=10, color=line.get_color())
    ax.set_xlabel("tokens trained (M)")
    ax.set_ylabel("eval loss (curve)")
    ax.set_title("evaluations: best (o) and early stop (x)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _plot_frontier(frontier: Sequence[FrontierPoint], chosen: str, rows: Sequence[Row], out: Path) -> None:
    """The cost objective's frontier (``DeploymentPlan.cost_frontier``: the cheapest plan the planner judged at
    each step time, on the expected batch): cost a step against step time, the chosen plan circled; beside it
    the simulated run of the plan: its mean step and mean cost a step (a cross), where the rows have a cost."""
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [p.makespan_s for p in frontier]
    costs = [p.cost_per_step for p in frontier]
    ax.plot(steps, costs, marker="o", drawstyle="steps-post", label="frontier (expected batch)")
    for p in frontier:
        ax.annotate(f"{p.gpus}", (p.makespan_s, p.cost_per_step), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if p.deployment == chosen:
            ax.plot(p.makespan_s, p.cost_per_step, "o", mfc="none", ms=14, color="black", label="chosen plan")
    ours = rows[0] if rows else {}
    if "cost_per_step" in ours:  # the baselines, far dearer, would squash the frontier: lorafleet's run alone
        label = f"{ours['method']}, mean of the simulated steps"
        ax.plot(float(ours["mean_step_s"]), float(ours["cost_per_step"]), "x", ms=9, color="red", label=label)
    ax.set(xlabel="step time (s)", ylabel="cost per step", title="Cost frontier: the cheapest plan at each step time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _frontier_section(frontier: Sequence[FrontierPoint], chosen: str) -> str:
    """The page's cost frontier (a plan of ``--objective cost``): the plot and its points."""
    if not frontier:
        return ""
    rows = [
        {
            "step_s": p.makespan_s,
            "cost_per_step": f"{p.cost_per_step:.4g}",
            "gpus": p.gpus,
            "deployment": p.deployment,
            "chosen": "yes" if p.deployment == chosen else "",
        }
        for p in frontier
    ]
    return f"""<h2>Cost frontier: the cheapest plan judged at each step time (expected batch)</h2>
<p>The plan was chosen by the cost objective; no other plan the planner judged is both faster and cheaper than a
point of this frontier (the numbers beside the points: GPUs held).</p>{_html_table(rows)}<img src="frontier.png">"""


def _plot_makespan(runs: Sequence[ScheduleRun], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for run in runs:
        ax.plot(run.makespan_s, marker="o", markersize=3, label=run.name)
    ax.set(xlabel="step", ylabel="step time (s)", title="Makespan per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_utilisation(run: ScheduleRun, out: Path) -> None:
    phase = run.phases[0]
    busy = np.array([r.replica_busy_s for r in phase.reports]).sum(axis=0)
    wall = sum(r.makespan_s for r in phase.reports)
    labels = [f"{r.replica_id}:{r.config}" for r in phase.phase.plan.replicas]
    fig, ax = plt.subplots(figsize=(max(5, 0.45 * len(labels)), 3.5))
    ax.bar(labels, busy / wall)
    ax.set(ylim=(0, 1.05), ylabel="busy / wall", title=f"Utilisation per replica ({run.name})")
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_lengths(workload: Workload, boundaries: Sequence[int], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    top = max(t.lengths.max_length for t in workload.tasks)
    bins = np.unique(np.geomspace(1, top, 60).astype(int))
    for task in workload.tasks:
        d = task.lengths
        ax.hist(d.lengths, bins=bins, weights=d.probs * task.batch_size, histtype="step", label=task.name)
    for b in boundaries:
        ax.axvline(b, color="grey", linewidth=0.6, linestyle=":")
    ax.set(
        xscale="log",
        xlabel="sequence length (tokens)",
        ylabel="sequences per step",
        title="Length distribution per task and the plan's bucket boundaries",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_gpu_seconds(rows: Sequence[Row], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([str(r["method"]) for r in rows], [float(r["gpu_s_per_step"]) for r in rows])
    ax.set(ylabel="GPU-seconds per step", title="GPU-seconds by method")
    ax.tick_params(axis="x", rotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


PERCENT_COLUMNS = frozenset({"utilisation", "padding_ratio", "saved_by_lorafleet", "cost_saved_by_lorafleet"})
"""Columns holding a fraction, shown as a percentage."""


def format_value(column: str, value: object) -> str:
    """A table cell as the report shows it: a fraction column (:data:`PERCENT_COLUMNS`) as a percentage
    with one decimal (``53.4 %``), other floats (seconds, GPU-seconds) with three decimals and thousands
    separators (``1,234.568``), integers (tokens, GPUs) with thousands separators, NaN as ``n/a``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if column in PERCENT_COLUMNS:
        return f"{100 * value:.1f} %"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.3f}"


def _html_table(rows: Sequence[Row]) -> str:
    if not rows:
        return "<p>(none)</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_value(k, v))}</td>" for k, v in r.items()) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _json_safe(rows: Sequence[Row]) -> list[Row]:
    """NaN (a task without tokens) as null: ``summary.json`` stays strict JSON."""
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]


def eval_totals(gpu_s: float, eval_gpu_s: float, reference_gpu_s: float | None = None) -> str:
    """One line: a run's evaluation GPU-seconds over the rest of its ``gpu_s`` (its steps', and its migrations'
    in a replay), and, with ``reference_gpu_s`` (the same run with no early stop), what early stopping saved."""
    rest = gpu_s - eval_gpu_s
    line = f"evaluations {eval_gpu_s:,.1f} GPU-s, {eval_gpu_s / rest:.2%} over the rest's {rest:,.1f}"
    if reference_gpu_s is None:
        return line
    saved = reference_gpu_s - gpu_s
    return f"{line}; early stopping saved {saved:,.1f} GPU-s ({saved / reference_gpu_s:.1%}) of {reference_gpu_s:,.1f}"


def _evals_section(run: ScheduleRun, rows: Sequence[Row], reference: ScheduleRun | None) -> str:
    """The page's evaluations: their GPU-seconds beside the steps', each task's best and stop, the curves."""
    if not rows:
        return ""
    ref_gpu_s = reference.total_gpu_seconds if reference is not None else None
    line = eval_totals(run.total_gpu_seconds, sum(run.eval_gpu_seconds.values()), ref_gpu_s)
    return f"""<h2>Evaluations and early stops</h2>
<p>{html.escape(line)} (against training every task to its steps).</p>
{_html_table(rows)}<img src="evals.png">"""


def write_report(
    out_dir: str | Path,
    workload: Workload,
    runs: Sequence[ScheduleRun],
    plan_rows: Sequence[Row],
    *,
    cluster: ClusterSpec,
    cost_source: str,
    reference: ScheduleRun | None = None,
) -> Path:
    """Plots, ``summary.json`` and ``index.html`` in ``out_dir`` (written to a temporary name, then renamed).

    ``cluster`` is the one simulated (after any ``--gpus``/``--gpu``) and ``cost_source`` the cost model's
    ``source`` (``analytic:A100-40GB``): the page's title and summary name both. ``reference``: the first run
    without early stops, when a task may stop (its evaluations' table gains the steps not taken).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(runs, cluster)
    pools = pool_rows(runs[0], cluster)
    ours = runs[0]
    _plot_makespan(runs, out / "makespan.png")
    _plot_utilisation(ours, out / "utilisation.png")
    _plot_lengths(workload, ours.phases[0].phase.plan.bucket_boundaries, out / "lengths.png")
    _plot_gpu_seconds(rows, out / "gpu_seconds.png")
    costs = task_cost_rows(ours)
    evals = eval_rows(ours.evals, reference.evals if reference is not None else None)
    if evals:
        _plot_evals(ours.evals, out / "evals.png")
    planned = ours.phases[0].phase.plan
    if planned.cost_frontier:
        _plot_frontier(planned.cost_frontier, planned.describe(), rows, out / "frontier.png")
    summary = {
        "cluster": {"gpu": " + ".join(cluster.kinds), "gpus": cluster.n_gpus},
        "pools": pools,
        "cost_model": cost_source,
        "methods": rows,
        "plan": list(plan_rows),
        "task_costs": _json_safe(costs),
        "evaluations": evals,
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    hardware = html.escape(cluster.describe())
    title = f"lorafleet simulation: {html.escape(workload.path)} on {hardware}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}</style></head><body>
<h1>Simulation of {html.escape(workload.path)} on {hardware}</h1>
<p>{len(workload.tasks)} tasks, {html.escape(workload.model.name)}, {hardware} ({html.escape(ours.name)}'s plan
holds {ours.gpus:,}), cost model {html.escape(cost_source)}, {len(ours.makespan_s):,} steps.</p>
<h2>Methods</h2>{_html_table(rows)}
<h2>lorafleet's deployment</h2>{_html_table(plan_rows)}
<h2>Pools: what {html.escape(ours.name)} holds and uses of each, and what it costs</h2>
<p>GPU-seconds held are every step's makespan x the GPUs the replicas hold in the pool; utilisation is
their busy share; cost is held GPU-hours at the pool's price.</p>{_html_table(pools)}
<h2>Who pays what: {html.escape(ours.name)}'s GPU-seconds per task</h2>
<p>Over the {len(ours.makespan_s)} steps, each step's GPU-seconds (makespan x GPUs held) are shared out among
the tasks by the simulated time of the replicas that ran their sequences; the replicas' idle time by all the
step's tasks, in proportion to their busy GPU-seconds.</p>{_html_table(costs)}
{_evals_section(ours, evals, reference)}{_frontier_section(planned.cost_frontier, planned.describe())}
<img src="gpu_seconds.png"><img src="makespan.png"><img src="utilisation.png"><img src="lengths.png">
</body></html>
"""
    return write_text_atomic(out / "index.html", page)
