"""Per-step dispatch: speed, and quality against the exact MILP and LobRA's length-based dispatch.

Scenarios (the workloads' own seeds; steps 0, 1, 2, ... sampled with lorafleet.sampling):

- ``7b``: examples/lobra-7b.yaml on LobRA's plan <1,1> x 6 + <2,1> x 1 + <8,1> x 1
  (16 A100-40GB) with LobRA's measured max tokens M (2048 / 4096 / 16384, from their
  artifact, ../shared/reference/lobra_a100_40gb_llama2_7b_max_tokens.csv).
- ``70b``: examples/lobra-70b.yaml on <2,2> x 8 + <4,2> x 2 + <8,2> x 1 (64 A800-80GB),
  with LobRA-style M of 4096 / 8192 / 16384 at TP 2 / 4 / 8: our choice, see docs/dispatch.md.
- ``service-64``: examples/service-64.yaml (64 tenants, 3,840 sequences a step) on the 84 replicas of
  15 configs that ``lorafleet plan examples/service-64.yaml`` chose on 1,024 A800-80GB on 2026-12-03 (wave 1; a fixed
  deployment, so the figures stay comparable: today's plan is 91 replicas of 13 configs), the analytic
  model's M, under the default policy (packed micro-batches, pipeline window 8): speed only.
- ``service-sweeps``: examples/service-sweeps.yaml (64 tasks, a 16-member sweep each: 1,024 tenants, 15,360
  sequences a step) on the 7 replicas of 5 configs ``lorafleet plan`` chooses for it on the same GPUs: speed only.

Times come from the analytic cost model of the workload's model and GPU
(``lorafleet.costmodel.load_cost_model``). Figures printed per scenario:

1. speed: dispatch_step (bucketing + assignment + micro-batches) wall and CPU time, p50/p95;
2. quality on ``--batches`` batches: the fast method's estimated makespan against the
   exact MILP's best solution within ``--exact-limit`` seconds (and the gap the solver
   proves), and against LobRA's length-based dispatch;
3. buckets: padding ratio and makespan by R, next to LobRA's Fig. 11, plus packing.

Two checks of a change to the dispatcher against another tree (a ``git worktree`` of the commit before):

- ``--digest``: per scenario, the sha256 over its steps of every micro-batch (sequences, tasks, lengths, padded
  length) and every estimate (each replica's, bit for bit, and the buckets): equal digests, the same dispatch;
- ``--against TREE``: the speed part run alternately on this tree and on TREE (``PYTHONPATH``, one subprocess a
  round each side, the same machine at the same load), the p50/p95 of both and their ratios.

Run ``python benchmarks/bench_dispatch.py --help`` for the flags; docs/dispatch.md records
the figures and the commands that produced them.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lorafleet.assemble import workload_cost_model
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.dispatch import (
    DispatchMethod,
    DispatchOptions,
    DispatchPolicy,
    MicroBatchMode,
    dispatch_step,
    solve_step,
)
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec
from lorafleet.presets import FLUSHED_PADDING
from lorafleet.sampling import sample_global_batch
from lorafleet.solvers import SolverName
from lorafleet.workload import load_workload

REPO = Path(__file__).resolve().parents[1]
LOBRA_R = {4: (1.00, 0.44), 8: (0.715, 0.23), 12: (0.645, 0.15), 16: (0.625, 0.11), 32: (0.63, 0.05)}
"""LobRA Fig. 11 (7B, 16 A100): R -> (step time relative to R = 4, padding ratio), read off the plot."""
QUALITY_TARGET = 0.03
"""The fast method's estimated makespan must be within 3% of the exact MILP's best solution."""

PADDED = MicroBatchMode.PADDING
"""The micro-batches these figures are for (LobRA's padded buckets; ``packing`` rows say so)."""


@dataclass(frozen=True)
class Scenario:
    workload: str
    layout: tuple[tuple[ParallelConfig, int], ...]
    max_tokens: dict[int, int] | None
    """M per TP degree given to the plan's replicas (None: the cost model's M of each config)."""
    p95_target_ms: float
    policy: DispatchPolicy = FLUSHED_PADDING
    """What the speed part dispatches under: LobRA's padded micro-batches, one-step windows (the policy these
    figures were first measured under), unless said otherwise."""
    speed_only: bool = False
    """No quality or bucket parts (their exact MILPs and bucket sweeps are for LobRA's two fleets)."""


SCENARIOS = {
    "7b": Scenario(
        "examples/lobra-7b.yaml",
        ((ParallelConfig(1), 6), (ParallelConfig(2), 1), (ParallelConfig(8), 1)),
        {1: 2048, 2: 4096, 8: 16384},
        p95_target_ms=50.0,
    ),
    "70b": Scenario(
        "examples/lobra-70b.yaml",
        ((ParallelConfig(2, 2), 8), (ParallelConfig(4, 2), 2), (ParallelConfig(8, 2), 1)),
        {2: 4096, 4: 8192, 8: 16384},
        p95_target_ms=200.0,
    ),
    "service-64": Scenario(
        "examples/service-64.yaml",
        tuple(
            (ParallelConfig.parse(name), count)
            for name, count in (
                ("tp1_pp8", 1),
                ("tp1_pp10", 6),
                ("tp1_pp16", 1),
                ("tp2_pp4", 8),
                ("tp2_pp5", 2),
                ("tp2_pp8", 3),
                ("tp2_pp10", 1),
                ("tp4_pp2", 9),
                ("tp4_pp4", 15),
                ("tp4_pp5", 1),
                ("tp8_pp1", 11),
                ("tp8_pp2", 10),
                ("tp8_pp4", 1),
                ("tp8_pp8", 1),
                ("tp8_pp1_rc", 14),
            )
        ),
        None,
        p95_target_ms=100.0,
        policy=DispatchPolicy(),
        speed_only=True,
    ),
    "service-sweeps": Scenario(
        "examples/service-sweeps.yaml",
        tuple(
            (ParallelConfig.parse(name), count)
            for name, count in (
                ("tp2_pp80", 1),
                ("tp4_pp40", 1),
                ("tp8_pp16", 2),
                ("tp8_pp16_rc", 1),
                ("tp8_pp40", 1),
            )
        ),
        None,
        p95_target_ms=100.0,
        policy=DispatchPolicy(),
        speed_only=True,
    ),
}
"""``service-sweeps``: 1,024 tenants (64 tasks, a 16-member sweep each), on the deployment ``lorafleet plan`` chooses
for them since the split LoRA inputs (2026-12-07, stop 51; from 2026-12-06 16:00 UTC it chose <2,80,rc> x 2 + <4,40> x 2
+ <8,10,rc> x 1 + <8,16> x 1 + <8,20> x 1, earlier that day <2,40,rc> x 1 + <2,80> x 1 + <2,80,rc> x 2 + <8,10,rc> x 2 +
<8,16> x 1 + <8,20> x 1)."""


def build(scenario: Scenario):
    """The scenario's workload, plan and analytic cost model."""
    workload = load_workload(REPO / scenario.workload)
    cost_model = workload_cost_model(
        workload, workload.cluster, sync_replicas=sum(count for _, count in scenario.layout)
    )
    replicas, gpu = [], 0
    for config, count in scenario.layout:
        m = scenario.max_tokens[config.tp] if scenario.max_tokens else cost_model.max_tokens(config)
        for _ in range(count):
            replicas.append(ReplicaSpec(len(replicas), config, m, tuple(range(gpu, gpu + config.n_gpus))))
            gpu += config.n_gpus
    plan = DeploymentPlan(
        model=workload.model.name,
        pools=(PlanPool("", workload.cluster.gpu, workload.cluster.n_gpus, workload.cluster.gpus_per_node),),
        tasks=tuple(t.name for t in workload.tasks),
        replicas=tuple(replicas),
        bucket_boundaries=(),
        expected_makespan_s=0.0,
        policy=scenario.policy,
    )
    return workload, plan, cost_model


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def collect_as_lorafleet() -> None:
    """This process's cyclic collector as lorafleet's processes that dispatch run it (every command and rank 0 of a
    training run: ``runtime.gc_policy``), so the benchmark's full collections are the ones a run gets; a tree from
    before that module (``--against``) set the same threshold in ``cli.main``."""
    try:
        from lorafleet.runtime.gc_policy import GC_GEN0_THRESHOLD
    except ImportError:
        from lorafleet.cli import GC_GEN0_THRESHOLD
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


class FullCollections:
    """Counts the interpreter's full garbage collections (generation 2) while active: each walks every object of the
    process (~40-60 ms in this benchmark's process), and the steps they land in set a 100-step p95. The dispatcher
    decides how often they come (every object a step keeps counts towards the next collection), not what one costs."""

    def __init__(self) -> None:
        self.count = 0

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.count += 1

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._seen)


def bench_speed(batches, plan, cost_model, target_ms: float) -> None:
    """``dispatch_step`` under the plan's policy (its micro-batches and pipeline window), step by step."""
    dispatch_step(batches[0], plan, cost_model)  # warm-up: imports, scipy's HiGHS
    wall, cpu = [], []
    with FullCollections() as full:
        for batch in batches:
            start = time.process_time()
            outcome = dispatch_step(batch, plan, cost_model)
            cpu.append(time.process_time() - start)
            wall.append(outcome.solve_s)
    wall_ms, cpu_ms = np.array(wall) * 1e3, np.array(cpu) * 1e3
    print(
        f"  speed, fast method ({plan.policy.describe()}), {len(batches)} steps: wall p50 "
        f"{np.median(wall_ms):.1f} ms, p95 "
        f"{np.percentile(wall_ms, 95):.1f} ms, max {wall_ms.max():.1f} ms; CPU p50 {np.median(cpu_ms):.1f} ms, p95 "
        f"{np.percentile(cpu_ms, 95):.1f} ms; {full.count} full garbage collections in them   [target p95 <= "
        f"{target_ms:.0f} ms: {verdict(np.percentile(wall_ms, 95) <= target_ms)} wall, "
        f"{verdict(np.percentile(cpu_ms, 95) <= target_ms)} CPU]"
    )


def step_digest(step) -> bytes:
    """sha256 of a StepPlan's buckets, every replica's micro-batches and estimate (floats by their repr, exact)."""
    h = hashlib.sha256(repr((step.bucket_boundaries, step.estimated_makespan_s)).encode())
    for w in step.work:
        h.update(repr((w.replica_id, w.estimated_time_s)).encode())
        for mb in w.microbatches:
            h.update(repr((mb.seq_ids, mb.task_ids, mb.lengths, mb.padded_len)).encode())
    return h.digest()


def digest(batches, plan, cost_model) -> str:
    """sha256 over the steps' :func:`step_digest`, the batches dispatched under the plan's policy."""
    h = hashlib.sha256()
    for batch in batches:
        h.update(step_digest(dispatch_step(batch, plan, cost_model)))
    return h.hexdigest()


def step_cpu_ms(batches, plan, cost_model) -> tuple[list[float], int]:
    """CPU ms of each step's ``dispatch_step`` (after one warm-up step), and the full garbage collections in them."""
    dispatch_step(batches[0], plan, cost_model)
    out = []
    with FullCollections() as full:
        for batch in batches:
            start = time.process_time()
            dispatch_step(batch, plan, cost_model)
            out.append((time.process_time() - start) * 1e3)
    return out, full.count


def against(name: str, tree: str, steps: int, rounds: int) -> None:
    """``step_cpu_ms`` of scenario ``name`` on this tree and ``tree`` alternately, ``rounds`` each, side by side."""
    times: dict[str, list[float]] = {"this": [], "base": []}
    full = {"this": 0, "base": 0}
    for _ in range(rounds):
        for side, path in (("base", tree), ("this", str(REPO))):
            env = dict(os.environ, PYTHONPATH=path)
            cmd = [sys.executable, __file__, "--scenarios", name, "--timing-steps", str(steps), "--raw"]
            out = subprocess.run(cmd, env=env, cwd=path, check=True, capture_output=True, text=True).stdout
            cpu_ms, collections = json.loads(out.splitlines()[-1])
            times[side] += cpu_ms
            full[side] += collections
    this, base = np.array(times["this"]), np.array(times["base"])
    p50, p95 = (np.median(this), np.median(base)), (np.percentile(this, 95), np.percentile(base, 95))
    print(
        f"{name}, CPU ms a step, {rounds} rounds of {steps} steps a side, interleaved: this tree p50 {p50[0]:.1f}, "
        f"p95 {p95[0]:.1f}; {tree} p50 {p50[1]:.1f}, p95 {p95[1]:.1f}; ratio p50 {p50[0] / p50[1]:.2f}x, "
        f"p95 {p95[0] / p95[1]:.2f}x; full garbage collections {full['this']} against {full['base']} "
        f"(OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}: "
        "process CPU counts OpenBLAS's spinning helper threads)"
    )


def bench_quality(batches, plan, cost_model, solver: SolverName, limit_s: float) -> None:
    fast_opts = DispatchOptions(microbatch_mode=PADDED)
    exact_opts = DispatchOptions(
        microbatch_mode=PADDED, method=DispatchMethod.EXACT, solver=solver, time_limit_s=limit_s, gap_rel=1e-6
    )
    rows = []
    for batch in batches:
        fast = solve_step(batch, plan, cost_model, fast_opts)
        length = solve_step(
            batch, plan, cost_model, DispatchOptions(microbatch_mode=PADDED, method=DispatchMethod.LENGTH)
        )
        exact = solve_step(batch, plan, cost_model, exact_opts)
        rows.append(
            (
                fast.plan.estimated_makespan_s,
                exact.plan.estimated_makespan_s,
                length.plan.estimated_makespan_s,
                fast.modelled_makespan_s,
                exact.modelled_makespan_s,
                exact.lower_bound_s or np.nan,
                exact.plan.method,
                exact.plan.solve_s,
            )
        )
    fast_est, exact_est, length_est, fast_model, exact_model, bound = (np.array([r[i] for r in rows]) for i in range(6))
    statuses = [r[6] for r in rows]
    exact_s = np.array([r[7] for r in rows])
    gap = fast_est / exact_est - 1
    proven = (exact_model - bound) / exact_model
    certified = (fast_model - bound) / bound
    n = len(rows)
    print(
        f"  quality on {n} batches, exact = {solver.value} MILP with {limit_s:g} s per batch "
        f"(solve time mean {exact_s.mean():.1f} s, max {exact_s.max():.1f} s; "
        f"{sum(s.endswith(':optimal') for s in statuses)} proven optimal, "
        f"{sum(s.endswith(':feasible') for s in statuses)} time-limited with a solution, "
        f"{sum(s.endswith('->fast') for s in statuses)} fell back):"
    )
    print(
        f"    fast vs exact, estimated makespan: mean {gap.mean():+.2%}, max {gap.max():+.2%}, "
        f"within {QUALITY_TARGET:.0%} on {(gap <= QUALITY_TARGET).sum()}/{n}   "
        f"[{verdict(bool((gap <= QUALITY_TARGET).all()))}]"
    )
    print(
        f"    gap the solver proves on its own solution (model): mean {np.nanmean(proven):.2%}, max "
        f"{np.nanmax(proven):.2%}; "
        f"fast vs the proven lower bound (model): mean {np.nanmean(certified):+.2%}, max {np.nanmax(certified):+.2%}"
    )
    better = fast_est <= length_est * (1 + 1e-9)
    print(
        f"    fast vs LobRA length-based dispatch: makespan {np.mean(fast_est / length_est - 1):+.1%} on average "
        f"(best {np.min(fast_est / length_est - 1):+.1%}), never worse on {better.sum()}/{n}   "
        f"[{verdict(bool(better.all()))}]"
    )
    print(
        f"    mean estimated makespan: fast {fast_est.mean():.3f} s, exact {exact_est.mean():.3f} s, "
        f"length {length_est.mean():.3f} s"
    )


def bench_buckets(batches, plan, cost_model) -> None:
    def run(**kw):
        outs = [
            solve_step(b, plan, cost_model, DispatchOptions(**({"microbatch_mode": PADDED} | kw))).plan for b in batches
        ]
        return np.mean([p.padding_ratio for p in outs]), np.mean([p.estimated_makespan_s for p in outs])

    results = {r: run(n_buckets=r) for r in LOBRA_R}
    base = results[4][1]
    print(f"  buckets over {len(batches)} batches (fast method): R, padding ratio (LobRA), makespan vs R = 4 (LobRA)")
    for r, (lobra_time, lobra_pad) in LOBRA_R.items():
        pad, makespan = results[r]
        print(
            f"    R = {r:2d}: padding {pad:.3f} ({lobra_pad:.2f}), makespan {makespan / base:.3f} ({lobra_time:.3f}), "
            f"{makespan:.3f} s"
        )
    pad16, span16 = results[16]
    for label, kw in (
        ("R chosen by makespan (<= 16)", {"choose_buckets_by_makespan": True}),
        ("packing, R = 16", {"microbatch_mode": MicroBatchMode.PACKING}),
    ):
        pad, makespan = run(**kw)
        print(
            f"    {label}: padding {pad:.3f}, makespan {makespan:.3f} s ({makespan / span16 - 1:+.1%} vs padding at "
            "R = 16)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--scenarios", default="7b,70b", help="comma-separated: 7b, 70b, service-64, service-sweeps (default 7b,70b)"
    )
    parser.add_argument("--timing-steps", type=int, default=100, help="steps timed per scenario (default 100)")
    parser.add_argument("--batches", type=int, default=50, help="batches compared with the exact MILP (default 50)")
    parser.add_argument("--exact-limit", type=float, default=60.0, help="seconds per exact solve (default 60)")
    parser.add_argument("--solver", default="highs", help="exact back end: highs (default), scip or cbc")
    parser.add_argument("--skip-exact", action="store_true", help="speed and buckets only")
    parser.add_argument("--digest", action="store_true", help="only the sha256 of the timed steps' dispatch")
    parser.add_argument("--against", metavar="TREE", help="speed only, alternately on this tree and TREE")
    parser.add_argument("--rounds", type=int, default=2, help="--against: rounds a side (default 2)")
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # --against's subprocesses
    args = parser.parse_args(argv)
    collect_as_lorafleet()
    for name in args.scenarios.split(","):
        if args.against:
            against(name.strip(), args.against, args.timing_steps, args.rounds)
            continue
        scenario = SCENARIOS[name.strip()]
        workload, plan, cost_model = build(scenario)
        n_batches = args.timing_steps if scenario.speed_only or args.digest else max(args.timing_steps, args.batches)
        batches = [sample_global_batch(workload, step) for step in range(n_batches)]
        if args.raw:
            print(json.dumps(step_cpu_ms(batches, plan, cost_model)))
            continue
        if args.digest:
            print(f"{name}: sha256 of {len(batches)} steps' dispatch {digest(batches, plan, cost_model)}")
            continue
        print(
            f"{name}: {scenario.workload}, {len(batches[0])} sequences a step, plan {plan.describe()} "
            f"(M {scenario.max_tokens}), cost model {cost_model.source}"
        )
        bench_speed(batches[: args.timing_steps], plan, cost_model, scenario.p95_target_ms)
        if scenario.speed_only:
            continue
        if not args.skip_exact:
            bench_quality(batches[: args.batches], plan, cost_model, SolverName(args.solver), args.exact_limit)
        bench_buckets(batches[: args.batches], plan, cost_model)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
