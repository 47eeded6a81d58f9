"""One fleet of two GPU kinds (#29): lorafleet on the mixed fleet against the pools planned apart, the tenants
split between the pools, and one fused config over every GPU, in simulation on the same batches.

Cases (LobRA's workloads; prices per GPU-hour are examples, one currency):

1. ``7b``: LobRA's 7B workload (``examples/lobra-7b.yaml``: 6 tasks, Llama2-7B, no recomputation) on
   16 x A100-40GB (2 nodes, 1.3) + 8 x H100-80GB (1 node, 2.5).
2. ``70b``: LobRA's 70B workload (``examples/lobra-70b.yaml``: 12 tasks, Llama2-70B, 16K contexts, the
   planner picks recomputation) on 32 x A800-80GB (4 nodes, 1.6) + 16 x H100-80GB (2 nodes, 2.5).

Methods:

- (a) lorafleet on the mixed fleet, ``--objective cost``: the cheapest step over every subset of the pools' GPUs
  (#43), and (a'') the same within a step-time limit of ``--limit`` x the fastest plan's expected step (and, beside
  them, (a') the default objective: the shortest step, then the fewest GPUs); (a''') the cost objective within
  (c)'s expected step (the slower pool's), so at least as fast as the split;
- (b) lorafleet on each pool alone, with all the tasks;
- (c) the tenants split between the pools in proportion to the pools' peak FLOPS (each task, largest
  expected tokens first, goes to the pool with the fewest tokens per peak FLOP so far), each pool planned
  by lorafleet for its own tasks. The fleet is held while both pools train their step: the makespan is
  the slower pool's, and the GPU-seconds and cost are those of every GPU the two plans use for that long.
  (c') is the same split with each pool paying only for its own steps (its makespan x its GPUs, as if the
  faster pool were released early or rented apart): the kinder accounting for the split;
- (d) Task-Fused packing over all GPUs: one layout that runs on both kinds, as many replicas as fit in
  each pool (the planner's fused baseline on a fleet, ``planner.baselines.best_across_pools``).

Every method runs ``--steps`` sampled global batches (the same ones: a task's draw depends on the seed,
the step and its name) through ``lorafleet.simulate`` on the analytic cost models of the pools' kinds,
without noise. Printed, per case, a markdown table of GPUs, mean makespan, GPU-seconds and cost per step;
then (a)'s saving in cost per step against (c) and (d), against the target of 15%; then (a)'s cost frontier (the
cheapest plan judged at each step time, on the expected batch: ``PlanResult.frontier``) and the expected step and
cost of (a), (a') and each (b), the figures ``lorafleet plan`` prints.

    .venv/bin/python benchmarks/bench_pools.py               # both cases (minutes on 2 cores)
    .venv/bin/python benchmarks/bench_pools.py --only 7b
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lorafleet.assemble import workload_cost_model
from lorafleet.planner import LORAFLEET, BaselineKind, PlannerOptions, PlanObjective, PlanResult, plan_deployment
from lorafleet.simulate import ScheduleRun, simulate_schedule
from lorafleet.specs.cluster import ClusterSpec, PoolSpec
from lorafleet.workload import Workload, load_workload, resolve_workload

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.15
"""(a) must cost at least this fraction less per step than (c) and (d)."""

CASES = {
    "7b": (
        "lobra-7b.yaml",
        (
            PoolSpec(name="a100", gpu="A100-40GB", nodes=2, gpus_per_node=8, price_per_gpu_hour=1.3),
            PoolSpec(name="h100", gpu="H100-80GB", nodes=1, gpus_per_node=8, price_per_gpu_hour=2.5),
        ),
    ),
    "70b": (
        "lobra-70b.yaml",
        (
            PoolSpec(name="a800", gpu="A800-80GB", nodes=4, gpus_per_node=8, price_per_gpu_hour=1.6),
            PoolSpec(name="h100", gpu="H100-80GB", nodes=2, gpus_per_node=8, price_per_gpu_hour=2.5),
        ),
    ),
}


@dataclass(frozen=True)
class Row:
    """One method's simulated steps: per step, the makespan, GPU-seconds and cost."""

    method: str
    plan: str
    gpus: int
    makespan_s: np.ndarray
    gpu_seconds: np.ndarray
    cost: np.ndarray

    def cells(self) -> list[str]:
        return [
            self.method,
            self.plan,
            str(self.gpus),
            f"{self.makespan_s.mean():.2f}",
            f"{self.gpu_seconds.mean():,.1f}",
            f"{self.cost.mean() * 1000:.2f}",
        ]


def on(workload: Workload, pools: tuple[PoolSpec, ...], tasks: tuple[str, ...] | None = None) -> Workload:
    """``workload`` on a cluster of ``pools``, keeping the tasks ``tasks`` (all when None)."""
    kept = tuple(t for t in workload.spec.tasks if tasks is None or t.name in tasks)
    spec = workload.spec.model_copy(update={"cluster": ClusterSpec(pools=pools), "tasks": kept})
    return resolve_workload(spec, workload.path)


def row_of(method: str, run: ScheduleRun, cluster: ClusterSpec, plan: str) -> Row:
    cost = run.cost_per_step(cluster)
    assert cost is not None, "every pool has a price"
    return Row(method, plan, run.gpus, run.makespan_s, run.gpu_seconds, cost)


EXPECTED: dict[str, PlanResult] = {}
"""Each method's plan, by its row's method name: its expected step and cost (and (a)'s frontier)."""


def planned(workload: Workload, steps: int, options: PlannerOptions, method: str = "") -> tuple[list[ScheduleRun], str]:
    """lorafleet's plan of ``workload`` on its cluster and its fused baselines, simulated."""
    cluster = workload.cluster
    cost_model = workload_cost_model(workload, cluster)
    result = plan_deployment(workload, cluster, cost_model, options)
    if method:
        EXPECTED[method] = result
    runs = [simulate_schedule(workload, s, result.cost_model, steps) for s in (result.schedule, *result.baselines)]
    return runs, result.plan.describe()


def split_by_flops(workload: Workload, pools: tuple[PoolSpec, ...]) -> dict[str, tuple[str, ...]]:
    """Each task, largest expected tokens a step first, to the pool with the fewest tokens per peak FLOP so far."""
    flops = {p.name: p.gpu_spec.bf16_tflops * p.n_gpus for p in pools}
    tokens = dict.fromkeys(flops, 0.0)
    tasks: dict[str, list[str]] = {name: [] for name in flops}
    for task in sorted(workload.tasks, key=lambda t: -t.expected_tokens):
        pool = min(flops, key=lambda name: (tokens[name] / flops[name], -flops[name]))
        tasks[pool].append(task.name)
        tokens[pool] += task.expected_tokens
    return {name: tuple(names) for name, names in tasks.items()}


def run_case(name: str, steps: int, limit: float) -> dict[str, object]:
    EXPECTED.clear()
    file, pools = CASES[name]
    base = load_workload(REPO / "examples" / file)
    fleet = on(base, pools)
    cluster = fleet.cluster
    started = time.process_time()
    rows: list[Row] = []

    cost = PlannerOptions(objective=PlanObjective.COST)
    cost_runs, cost_plan = planned(fleet, steps, cost, "(a)")
    rows.append(row_of("(a) lorafleet, cheapest step", cost_runs[0], cluster, cost_plan))
    fast_runs, fast_plan = planned(fleet, steps, PlannerOptions(), "(a')")
    rows.append(row_of("(a') lorafleet, fastest step", fast_runs[0], cluster, fast_plan))
    bound = limit * EXPECTED["(a')"].plan.expected_makespan_s
    runs, plan = planned(fleet, steps, replace(cost, max_step_s=bound, baselines=False), "(a'')")
    rows.append(row_of(f"(a'') lorafleet, cheapest step within {bound:.3g} s", runs[0], cluster, plan))

    for pool in pools:
        alone = on(base, (pool,))
        runs, plan = planned(alone, steps, PlannerOptions(baselines=False), f"(b) {pool.name}")
        rows.append(row_of(f"(b) lorafleet on {pool.name} alone", runs[0], alone.cluster, plan))

    parts = []
    for pool_name, tasks in split_by_flops(base, pools).items():
        pool = next(p for p in pools if p.name == pool_name)
        part = on(base, (pool,), tasks)
        runs, plan = planned(part, steps, PlannerOptions(baselines=False), f"(c) {pool.name}")
        parts.append((row_of(pool.name, runs[0], part.cluster, plan), tasks))
    split_step = max(EXPECTED[f"(c) {p.name}"].plan.expected_makespan_s for p in pools)
    runs, plan = planned(fleet, steps, replace(cost, max_step_s=split_step, baselines=False), "(a''')")
    rows.append(row_of(f"(a''') lorafleet, cheapest step within (c)'s, {split_step:.3g} s", runs[0], cluster, plan))
    split = "; ".join(f"{r.method}: {len(t)} tasks, {r.plan}" for r, t in parts)
    slowest = np.max([r.makespan_s for r, _ in parts], axis=0)
    held_gpus = sum(r.gpus for r, _ in parts)
    per_second = sum(r.cost.sum() / r.makespan_s.sum() for r, _ in parts)  # each part's price a second
    rows.append(
        Row("(c) tenants split by peak FLOPS", split, held_gpus, slowest, slowest * held_gpus, slowest * per_second)
    )
    rows.append(
        Row(
            "(c') the same, each pool paying its own steps",
            "",
            held_gpus,
            slowest,
            np.sum([r.gpu_seconds for r, _ in parts], axis=0),
            np.sum([r.cost for r, _ in parts], axis=0),
        )
    )
    fused = next(r for r in cost_runs if r.name == BaselineKind.TASK_FUSED_PACKING.value)
    rows.append(row_of("(d) Task-Fused packing, all GPUs", fused, cluster, fused.phases[0].phase.plan.describe()))

    print(f"\n### {name}: {fleet.path}, {len(fleet.tasks)} tasks, {cluster.describe()}, {steps} sampled steps\n")
    print("| method | plan | GPUs | makespan s | GPU-s / step | cost / 1000 steps |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    ours = rows[0].cost.mean()
    savings = {r.method.split()[0]: 1 - ours / r.cost.mean() for r in rows if r.method.startswith(("(c", "(d)"))}
    for method, saving in savings.items():
        verdict = "meets" if saving >= TARGET else "misses"
        print(f"\n(a) costs {saving:.1%} less per step than {method} ({verdict} the {TARGET:.0%} target)")
    same_speed = next(r for r in rows if r.method.startswith("(a''')"))
    for split_row in (r for r in rows if r.method.startswith("(c")):
        saving = 1 - same_speed.cost.mean() / split_row.cost.mean()
        verdict = "meets" if saving >= TARGET else "misses"
        print(
            f"\n(a''') (no slower a step than (c), expected) costs {saving:.1%} less per step than "
            f"{split_row.method.split()[0]} ({verdict} the {TARGET:.0%} target)"
        )
    print(f"\n(a)'s cost frontier on the expected batch ({len(EXPECTED['(a)'].frontier)} points):\n")
    print("| step s | cost / 1000 steps | GPUs | deployment |")
    print("|---:|---:|---:|---|")
    for point in EXPECTED["(a)"].frontier:
        print(f"| {point.makespan_s:.2f} | {point.cost_per_step * 1000:.2f} | {point.gpus} | `{point.deployment}` |")
    print("\nexpected batch, as `lorafleet plan` prints it:\n")
    print("| method | plan | GPUs | step s | cost / 1000 steps |")
    print("|---|---|---:|---:|---:|")
    for method, result in EXPECTED.items():
        ours = result.cost(LORAFLEET)
        print(
            f"| {method} | `{result.plan.describe()}` | {ours.gpus} | {ours.makespan_s:.2f} | "
            f"{ours.cost_per_step * 1000:.2f} |"
        )
    print(f"\n{time.process_time() - started:.0f} CPU s")
    return {
        "case": name,
        "rows": [
            dict(zip(("method", "plan", "gpus", "makespan_s", "gpu_s", "cost_per_1000"), r.cells())) for r in rows
        ],
        "savings": savings,
        "frontier": [
            {"makespan_s": p.makespan_s, "cost_per_step": p.cost_per_step, "gpus": p.gpus, "deployment": p.deployment}
            for p in EXPECTED["(a)"].frontier
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), help="one case")
    parser.add_argument("--steps", type=int, default=8, help="sampled global batches per method (default 8)")
    parser.add_argument(
        "--limit", type=float, default=1.25, help="(a'')'s step-time limit, x the fastest plan's step (default 1.25)"
    )
    parser.add_argument("--json", help="also write the tables here")
    args = parser.parse_args()
    results = [run_case(name, args.steps, args.limit) for name in ([args.only] if args.only else CASES)]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
