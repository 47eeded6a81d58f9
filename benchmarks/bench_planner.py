"""Planner benchmark: plan time at scale, optimality against exhaustive search, GPU-seconds against the baselines.

Run from the repository root (every figure is measured here, in one run)::

    .venv/bin/python benchmarks/bench_planner.py            # parts 1-3
    .venv/bin/python benchmarks/bench_planner.py --part time --part quality
    .venv/bin/python benchmarks/bench_planner.py --part time --case 70b-64 --rounds 3   # one case (~15 s)
    .venv/bin/python benchmarks/bench_planner.py --part time --against ../before   # side by side with a checkout
    .venv/bin/python benchmarks/bench_planner.py --part time --cached-bytecode   # as installed: modules compiled once
    .venv/bin/python benchmarks/bench_planner.py --part robust   # part 4 (~1.5 min)
    .venv/bin/python benchmarks/bench_planner.py --part judge    # part 5 (~1 min)
    .venv/bin/python benchmarks/bench_planner.py --part baselines --rounds 2   # part 6 (~1 min)

1. **Plan time** (issue #43's targets) — the whole ``lorafleet plan`` command, each in a fresh process,
   default options (CBC, K = 32 sampled batches, baselines), analytic A800-80GB: ``examples/lobra-70b.yaml``
   (Llama2-70B, 12 tasks, LobRA's 16K contexts: the planner chooses which replicas recompute activations;
   without recomputation no 70B config holds more than ~13.6K tokens) on 64 and 256 GPUs, and the service-scale
   ``examples/service-64.yaml`` and ``service-128.yaml`` on 1,024, and LobRA's 7B workload
   (``examples/lobra-7b.yaml``, 16 x A100-40GB), against the 7.0 CPU s issue #43 quotes for LobRA's own planner
   (``bench_lobra_planner.py`` runs that planner here, side by side: 2.6-5.7 CPU s). CPU seconds (the
   process plus its CBC processes: the machine is shared, CPU time is the steadier figure; the least of
   ``--rounds`` runs, cases taking turns) beside those recorded in ``benchmarks/planner_times.json``
   (``--record`` writes them, with the machine and the date) and the ratio; LobRA's pruning planner took 148.8 s at 64
   GPUs and 428.1 s at 256 (SCIP on up to 64 threads).
2. **Optimality** — random workloads small enough to enumerate (Llama2-7B on 8 x A100-40GB,
   2-4 skewed tasks): the planner's expected makespan against the best of every maximal
   deployment of every valid config (exhaustive mode); plus tiny instances (4 GPUs) against
   LobRA's joint MINLP on SCIP.
3. **Quality** — ``examples/lobra-7b.yaml`` on 16 x A100-40GB (analytic): expected step time
   and GPU-seconds of lorafleet and each baseline, on the expected batch and as the mean
   over 32 sampled batches dispatched step by step; and the makespan the planner ranked the
   plan by beside the dispatcher's estimate of the same step (equal) and the load model's.
4. **Robust race** — ``robust_top`` 2 against 3 (the default) on a small two-task workload and
   LobRA's 7B and 70B experiments: the chosen plan's mean GPU-seconds on 32 held-out sampled
   batches, and the planner's CPU seconds.
6. **Task-Sequential's choices** (``--part baselines``) — the service-scale examples' Task-Sequential phases with
   the padded choice and the dispatched expected step shared by tasks of equal expected lengths
   (``baselines._phase``'s ``chosen``, what the planner does) against each task's phase chosen and dispatched alone,
   in this process, taking turns: CPU seconds, the ratio, and the phases' plans compared (equal).
5. **Judging packed plans** — every deployment the search judged on LobRA's 7B and 70B
   experiments (packed micro-batches, the default): the load model's makespan as placed (what
   the planner ranked by before it priced the packed step) against the dispatcher's estimate
   (what it ranks by now), how often the two orders disagree among the 8 best, and how much
   slower the load model's pick is; and the same gap on the dispatch tests' fleets
   (``lorafleet/presets.py``) on lognormal batches.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import yaml
from reproduce_lobra import EIGHT, FOUR, SECOND_TENANTS, with_tasks

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.dispatch import DispatchOptions, DispatchPolicy, MicroBatchMode, solve_step
from lorafleet.dispatch.load import config_classes
from lorafleet.dispatch.placement import placed_times
from lorafleet.dispatch.step import choose_buckets
from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner import LORAFLEET, PlannerMode, PlannerOptions, PlanResult, plan_deployment
from lorafleet.planner.baselines import _phase
from lorafleet.planner.candidates import propose_candidates, valid_candidates
from lorafleet.planner.evaluation import PoolEntry, evaluate
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.problem import build_problem
from lorafleet.planner.search import minlp_pool, search
from lorafleet.plans import DeploymentPlan
from lorafleet.presets import FLUSHED_PADDING
from lorafleet.sampling import sample_global_batch
from lorafleet.specs.recompute import RecomputePolicy
from lorafleet.work import cpu_seconds
from lorafleet.workload import Workload, load_workload, resolve_workload

REPO = Path(__file__).resolve().parents[1]


TIME_CASES: dict[str, tuple[str, list[str], float]] = {
    "70b-64": ("LobRA 70B, 12 tasks, 64 GPUs", ["examples/lobra-70b.yaml", "--gpus", "64"], 2.5),
    "70b-256": ("LobRA 70B, 12 tasks, 256 GPUs", ["examples/lobra-70b.yaml", "--gpus", "256"], 5.0),
    "service-64": ("64 tenants, 1,024 GPUs", ["examples/service-64.yaml"], 8.0),
    "service-128": ("128 tenants, 1,024 GPUs", ["examples/service-128.yaml"], 15.0),
    "7b": ("LobRA 7B, 6 tasks, 16 GPUs", ["examples/lobra-7b.yaml"], 1.4),
    "service-sweeps": ("1,024 tenants (64 sweeps), 1,024 GPUs", ["examples/service-sweeps.yaml"], 60.0),
}
"""The planner's time targets (issue #43; #26's were 5, 12, 20 and 40 s): case -> (what, ``lorafleet plan``
arguments, target CPU s). ``7b``: LobRA's own planner took 7.0 CPU s on its 7B workload (issue #43, side by
side on its cost data, on another machine); the target is 5x less. On this machine ``bench_lobra_planner.py`` runs
that planner side by side and measures the ratio itself (5x of its TP 4 side is ~1.14 s here: docs/planner.md).
``service-sweeps``: 64 tasks, each a 16-member sweep (issue #40's scale target)."""
TIMES_FILE = REPO / "benchmarks/planner_times.json"
"""CPU seconds recorded for each case (``--record``), with the machine, its load and the date."""


def machine() -> str:
    """``2 CPUs, Intel(R) Xeon(R) ...``: what the figures were measured on."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{os.cpu_count()} CPUs, {names[0] if names else platform.processor() or platform.machine()}"


def cached_bytecode_env() -> dict[str, str]:
    """This environment with compiled modules kept (``--cached-bytecode``). This development environment sets
    ``PYTHONDONTWRITEBYTECODE=1``, so every command compiles lorafleet's ~110 modules from source (~0.14 CPU s a
    command), which an installed package does once; here the commands keep their bytecode under a scratch
    ``PYTHONPYCACHEPREFIX`` (no tree is written), so from the second round on they run as installed."""
    cache = tempfile.mkdtemp(prefix="bench_planner_pycache_")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    kept = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return kept | {"PYTHONPYCACHEPREFIX": cache}


def plan_command_cpu(argv: list[str], tree: Path = REPO, env: dict[str, str] | None = None) -> tuple[float, str, str]:
    """CPU seconds of a whole ``lorafleet plan`` command in a fresh process (its CBC solves included), its
    timing line and its work counts (the plan's ``work:`` note); run in ``tree`` (a checkout of this repository:
    ``python -m`` plans the tree it starts in), in ``env`` (None: this process's environment)."""
    with tempfile.TemporaryDirectory() as scratch:
        written = Path(scratch) / "plan.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(
            [sys.executable, "-m", "lorafleet", "plan", *argv, "--json", str(written)],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        notes = json.loads(written.read_text())["notes"]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    laps = next((line.strip() for line in done.stdout.splitlines() if "planned in" in line), "")
    work = next((note.removeprefix("work: ") for note in notes if note.startswith("work: ")), "")
    return cpu, laps, work


def part_time(cases: list[str], rounds: int, record: bool, env: dict[str, str] | None = None) -> None:
    """Every case's ``lorafleet plan`` command, ``rounds`` times in turn (a busy machine slows each alike),
    its least CPU seconds beside the committed figure (``benchmarks/planner_times.json``) and the target."""
    print(f"\n== 1. plan time: the whole `lorafleet plan` command, CPU seconds (least of {rounds}) ==")
    recorded = json.loads(TIMES_FILE.read_text()) if TIMES_FILE.exists() else {"cases": {}}
    runs: dict[str, list[tuple[float, str, str]]] = {case: [] for case in cases}
    for _ in range(rounds):
        for case in cases:
            runs[case].append(plan_command_cpu(TIME_CASES[case][1], env=env))
    print(f"{'case':<32} {'CPU s':>7} {'recorded':>9} {'ratio':>6} {'target':>7}  timing of the least")
    measured, work = {}, {}
    for case in cases:
        what, _, target = TIME_CASES[case]
        cpu, laps, work[case] = min(runs[case])
        measured[case] = round(cpu, 2)
        before = recorded["cases"].get(case)
        ratio = f"{cpu / before:.2f}" if before else "-"
        verdict = "pass" if cpu <= target else "MISS"
        print(f"{what:<32} {cpu:>7.2f} {before or '-':>9} {ratio:>6} {target:>5.1f} {verdict}  {laps}")
    load = os.getloadavg()[0]
    print(f"(recorded: {recorded.get('machine', '-')}, {recorded.get('date', '-')}; 1-minute load now {load:.1f})")
    if record:
        TIMES_FILE.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "date": time.strftime("%Y-%m-%d"),
                    "load": round(load, 1),
                    "command": "python benchmarks/bench_planner.py --part time --record",
                    "cases": {**recorded["cases"], **measured},
                    "work": {**recorded.get("work", {}), **work},
                },
                indent=1,
            )
            + "\n"
        )
        print(f"recorded in {TIMES_FILE.relative_to(REPO)}")


def part_time_against(cases: list[str], rounds: int, tree: Path, env: dict[str, str] | None = None) -> None:
    """Every case's ``lorafleet plan`` command in this tree and in ``tree`` (the tree before a change), taking turns
    case by case and round by round so a busy machine slows both alike: each side's least CPU seconds, their ratio,
    and this side's work counts (the other side's beside them where they differ)."""
    print(f"\n== 1. plan time against {tree}: CPU seconds, least of {rounds} a side, taking turns ==")
    sides = {"this": REPO, "before": tree}
    runs: dict[tuple[str, str], list[tuple[float, str, str]]] = {(c, s): [] for c in cases for s in sides}
    loads = []
    for _ in range(rounds):
        for case in cases:
            for side, where in sides.items():
                runs[case, side].append(plan_command_cpu(TIME_CASES[case][1], where, env))
                loads.append(os.getloadavg()[0])
    print(f"{'case':<32} {'before':>7} {'this':>7} {'ratio':>6}  work (this; * where the sides differ)")
    for case in cases:
        before, this = min(runs[case, "before"]), min(runs[case, "this"])
        same = "" if before[2] == this[2] else f"  * before: {before[2]}"
        print(
            f"{TIME_CASES[case][0]:<32} {before[0]:>7.2f} {this[0]:>7.2f} {this[0] / before[0]:>6.2f}  {this[2]}{same}"
        )
    print(f"1-minute load {min(loads):.1f}-{max(loads):.1f} during the runs")


def random_workload(rng: np.random.Generator, path: Path, recompute: str = "auto") -> Workload:
    tasks = []
    for k in range(int(rng.integers(2, 5))):
        context = int(rng.choice([2048, 4096, 8192]))
        lengths = np.minimum(
            np.exp(rng.normal(np.log(rng.uniform(100, 900)), rng.uniform(0.5, 1.2), 300)).astype(int) + 1, context
        )
        values, counts = np.unique(lengths, return_counts=True)
        tasks.append(
            {
                "name": f"t{k}",
                "batch_size": int(rng.choice([32, 64, 128])),
                "context_length": context,
                "lengths": {"histogram": {int(v): int(c) for v, c in zip(values, counts)}},
            }
        )
    path.write_text(
        yaml.safe_dump(
            {
                "model": "llama2-7b",
                "cluster": {"gpu": "A100-40GB", "nodes": 1, "gpus_per_node": 8},
                "recompute": recompute,
                "seed": int(rng.integers(1000)),
                "tasks": tasks,
            }
        )
    )
    return load_workload(path)


def part_optimality(n_workloads: int, tmp: Path, recompute: str = "auto") -> None:
    print(
        f"\n== 2. optimality: {n_workloads} random workloads, llama2-7b on 8 x A100-40GB (analytic), recompute "
        f"{recompute} =="
    )
    options = PlannerOptions(robust_samples=0, baselines=False)
    gaps, plans, times = [], [], []
    for seed in range(n_workloads):
        workload = random_workload(np.random.default_rng(seed), tmp / f"random-{seed}.yaml", recompute)
        cluster = workload.cluster
        cost_model = workload_cost_model(workload, cluster)
        start = time.perf_counter()
        ours = plan_deployment(workload, cluster, cost_model, options)
        times.append(time.perf_counter() - start)
        best = plan_deployment(
            workload,
            cluster,
            cost_model,
            PlannerOptions(mode=PlannerMode.EXHAUSTIVE, robust_samples=0, baselines=False),
        )
        plans.append(len(best.diagnostics.pool))
        gaps.append(ours.plan.expected_makespan_s / best.plan.expected_makespan_s - 1)
    gaps = np.array(gaps)
    if gaps.size:
        print(
            f"expected makespan vs exhaustive ({min(plans)}-{max(plans)} deployments each): "
            f"mean gap {gaps.mean():+.2%}, worst {gaps.max():+.2%}, within 1 %: {(gaps <= 0.01).sum()}/{gaps.size}; "
            f"planner {np.mean(times):.2f} s per workload"
        )

    print(
        "tiny instances (4 x A100-40GB, configs <1,1> <1,2> <2,1>) against LobRA's joint MINLP on SCIP, same "
        "candidates:"
    )
    configs = {ParallelConfig(1, 1), ParallelConfig(1, 2), ParallelConfig(2, 1)}
    for seed in (1, 2, 4):  # instances SCIP proves in under a minute here (others take minutes)
        workload = random_workload(np.random.default_rng(100 + seed), tmp / f"tiny-{seed}.yaml")
        cluster = workload_cluster(workload, 4)
        cost_model = workload_cost_model(workload, cluster)
        candidates = [c for c in valid_candidates(cost_model, cluster) if c.config in configs]
        problem = build_problem(expected_global_batch(workload), candidates, cost_model, cluster, FLUSHED_PADDING)
        if not problem.covers(np.ones(len(candidates), dtype=np.int64)):
            continue
        start = time.perf_counter()
        _, ranked = search(problem, options)
        ours_s = time.perf_counter() - start
        minlp = minlp_pool(problem, PlannerOptions(time_limit_s=120))
        value = evaluate(problem, minlp.pool[0].load, exact=False, options=options)[0].makespan
        print(
            f"  seed {seed}: MINLP {minlp.solves[0]} in {minlp.solves[0].wall_s:.1f} s, decomposition {ours_s:.1f} s; "
            f"decomposition's plan vs the MINLP's {ranked[0].expected_makespan / value - 1:+.2%}"
        )


def chosen_entry(result: PlanResult) -> PoolEntry:
    """The pool entry of the plan ``result`` chose: the judged deployment with the plan's replica counts."""
    deployed = Counter(r.config for r in result.plan.replicas)
    return next(
        e
        for e in result.diagnostics.pool
        if e.expected is not None
        and Counter({c.config: int(n) for c, n in zip(result.diagnostics.candidates, e.replicas) if n}) == deployed
    )


def part_quality() -> None:
    print("\n== 3. quality: examples/lobra-7b.yaml, 16 x A100-40GB (analytic) ==")
    workload = load_workload(REPO / "examples/lobra-7b.yaml")
    cluster = workload.cluster
    cost_model = workload_cost_model(workload, cluster)
    result = plan_deployment(workload, cluster, cost_model)
    chosen = chosen_entry(result)
    print(
        f"plan: {result.plan.describe()}; the planner judged it at {chosen.expected_makespan:.3f} s, the dispatcher "
        f"estimates {result.expected_step.estimated_makespan_s:.3f} s (the load model as placed: "
        f"{placed_times(chosen.load, chosen.expected.class_counts).max():.3f} s)"
    )
    batches = [sample_global_batch(workload, step) for step in range(32)]
    schedules = (result.schedule, *result.baselines)
    sampled = {s.name: [s.step_cost(b, cost_model) for b in batches] for s in schedules}
    ours = result.cost(LORAFLEET)
    ours_sampled = np.mean([c.gpu_seconds for c in sampled[LORAFLEET]])
    print(
        f"{'method':<20} {'GPUs':>5} {'step s':>8} {'GPU-s':>8} {'lorafleet saves':>16} {'sampled GPU-s':>14} "
        f"{'saves':>7}"
    )
    for cost in result.costs:
        gpu_s = np.mean([c.gpu_seconds for c in sampled[cost.name]])
        cut = "" if cost.name == LORAFLEET else f"{1 - ours.gpu_seconds / cost.gpu_seconds:.1%}"
        cut_s = "" if cost.name == LORAFLEET else f"{1 - ours_sampled / gpu_s:.1%}"
        print(
            f"{cost.name:<20} {cost.gpus:>5} {cost.makespan_s:>8.3f} {cost.gpu_seconds:>8.1f} {cut:>16} "
            f"{gpu_s:>14.1f} {cut_s:>7}"
        )


def part_robust(tmp: Path) -> None:
    """``robust_top`` 2 against 3: planner CPU time and the chosen plan's mean GPU-seconds on 32
    held-out sampled batches (steps 100-131, past the race's K = 32)."""
    print("\n== 4. robust race: 2 or 3 finalists; mean GPU-s per step on 32 held-out batches ==")
    small = REPO / "examples/two-tenants.yaml"  # 56 sequences a step on 8 GPUs: few per bucket
    seven, seventy = load_workload(REPO / "examples/lobra-7b.yaml"), load_workload(REPO / "examples/lobra-70b.yaml")
    seven_rc = resolve_workload(seven.spec.model_copy(update={"recompute": RecomputePolicy.AUTO}), seven.path)
    cases = [
        ("2 tasks, 56 sequences", load_workload(small), 8),
        ("7B", seven, 16),
        ("7B, recompute auto", seven_rc, 16),
        *(("70B, 4 tasks", with_tasks(seventy, FOUR), gpus) for gpus in (16, 32, 64)),
        ("70B, 8 tasks", with_tasks(seventy, EIGHT), 64),
        ("70B, 12 tasks", seventy, 64),
        ("70B, 16 tasks", with_tasks(seventy, twins=SECOND_TENANTS), 64),
    ]
    cpu_total = {2: 0.0, 3: 0.0}
    for label, workload, gpus in cases:
        cluster = workload_cluster(workload, gpus)
        cost_model = workload_cost_model(workload, cluster)
        held_out = [sample_global_batch(workload, step) for step in range(100, 132)]
        row = {}
        for top in (2, 3):
            cpu = cpu_seconds()
            result = plan_deployment(workload, cluster, cost_model, PlannerOptions(robust_top=top, baselines=False))
            cpu_total[top] += cpu_seconds() - cpu
            row[top] = (
                result.plan.describe(),
                np.mean([result.schedule.step_cost(b, cost_model).gpu_seconds for b in held_out]),
            )
        change = (
            "same plan" if row[2][0] == row[3][0] else f"{row[3][1] / row[2][1] - 1:+.2%}: {row[2][0]} -> {row[3][0]}"
        )
        print(f"{label} on {gpus} GPUs: {row[2][1]:.2f} -> {row[3][1]:.2f} GPU-s ({change})", flush=True)
    print(f"planner CPU seconds in all: {cpu_total[2]:.1f} (2 finalists) -> {cpu_total[3]:.1f} (3)")


def part_judge() -> None:
    """The load model as placed against the dispatcher's estimate, on every judged deployment."""
    print("\n== 5. judging packed plans: load model as placed vs the dispatcher's estimate of the expected step ==")
    seven, seventy = load_workload(REPO / "examples/lobra-7b.yaml"), load_workload(REPO / "examples/lobra-70b.yaml")
    cases = [
        ("7B", seven, 16),
        ("70B, 12 tasks", seventy, 64),
        ("70B, 12 tasks", seventy, 256),
        *(("70B, 4 tasks", with_tasks(seventy, FOUR), gpus) for gpus in (16, 32, 64)),
        ("70B, 8 tasks", with_tasks(seventy, EIGHT), 64),
        ("70B, 16 tasks", with_tasks(seventy, twins=SECOND_TENANTS), 64),
    ]
    options, top = PlannerOptions(), 8
    for label, workload, gpus in cases:
        cluster = workload_cluster(workload, gpus)
        cost_model = workload_cost_model(workload, cluster)
        expected = expected_global_batch(workload)
        candidates = propose_candidates(valid_candidates(cost_model, cluster), int(expected.lengths.max()))
        _, ranked = search(build_problem(expected, candidates, cost_model, cluster, options.policy), options)
        estimate = np.array([e.expected_makespan for e in ranked])
        model = np.array([placed_times(e.load, e.expected.class_counts).max() for e in ranked])
        gap = model / estimate - 1
        k = min(top, len(ranked))
        discordant = sum(
            (model[a] - model[b]) * (estimate[a] - estimate[b]) < 0 for a in range(k) for b in range(a + 1, k)
        )
        pick = int(np.argmin(model))
        print(
            f"{label} on {gpus} GPUs: {len(ranked)} judged, load model / estimate - 1 from {gap.min():+.1%} to "
            f"{gap.max():+.1%} (mean {gap.mean():+.1%}); {discordant} of {k * (k - 1) // 2} pairs of the {k} best "
            f"ordered differently; the load model's pick is {estimate[pick] / estimate.min() - 1:+.1%} slower",
            flush=True,
        )
    from lorafleet import presets as fleet

    cost_model = fleet.lobra_7b_cost_model()
    options = DispatchOptions(microbatch_mode=MicroBatchMode.PACKING)
    for layout in (
        fleet.LOBRA_7B_PLAN,
        ((fleet.TP1, 4), (fleet.TP2_PP2, 1), (fleet.TP8, 1)),
        ((fleet.TP2_PP2, 2), (fleet.TP4, 2), (fleet.TP8, 1)),
    ):
        plan = fleet.make_plan(layout)
        gaps = []
        for scale in (0.1, 0.5, 1.0):
            for step in range(5):
                batch = fleet.lognormal_batch(step, scale=scale)
                out = solve_step(batch, plan, cost_model, options)
                _, load, assignment = choose_buckets(batch, config_classes(plan, cost_model), cost_model, options)
                gaps.append(placed_times(load, assignment.counts).max() / out.plan.estimated_makespan_s - 1)
        print(
            f"fleet {plan.describe()}, 15 lognormal batches (0.1-1x LobRA's 7B batch): load model / estimate - 1 "
            f"from {min(gaps):+.1%} to {max(gaps):+.1%} (mean {np.mean(gaps):+.1%})"
        )


def sequential_phases(workload: Workload, shared: bool) -> tuple[float, list[DeploymentPlan]]:
    """CPU seconds of ``workload``'s Task-Sequential phases on its own cluster (the default policy), and their plans:
    the padded choice and expected step shared by tasks of equal expected lengths (``shared``, what the planner does)
    or each made alone."""
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster)
    expected, valid, policy = expected_global_batch(workload), valid_candidates(cost_model, cluster), DispatchPolicy()
    chosen: dict | None = {} if shared else None
    padding = MicroBatchMode.PADDING
    start = cpu_seconds()
    phases = [
        _phase(workload, (k,), expected, valid, cost_model, cluster, padding, policy, "seq", chosen)
        for k in range(len(workload.tasks))
    ]
    return cpu_seconds() - start, [phase.plan for phase in phases]


def part_baselines(rounds: int) -> None:
    """Part 6: Task-Sequential's phases of the service-scale examples, shared choices against each alone."""
    print(f"\n== 6. Task-Sequential: choices shared by equal expected lengths vs alone, CPU s, least of {rounds} ==")
    for name in ("service-64", "service-128", "service-sweeps"):
        workload = load_workload(REPO / f"examples/{name}.yaml")
        runs: dict[bool, list[tuple[float, list[DeploymentPlan]]]] = {False: [], True: []}
        for _ in range(rounds):
            for shared in (False, True):
                runs[shared].append(sequential_phases(workload, shared))
        alone, shared = min(t for t, _ in runs[False]), min(t for t, _ in runs[True])
        same = "equal" if runs[False][0][1] == runs[True][0][1] else "DIFFER"
        tasks = len(workload.tasks)
        print(
            f"{name:<16} {tasks:>5} tasks  alone {alone:6.2f}  shared {shared:6.2f}  {shared / alone:.2f}  plans {same}"
        )
    print(f"1-minute load {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", action="append", choices=("time", "optimality", "quality", "robust", "judge", "baselines")
    )
    parser.add_argument(
        "--case", action="append", choices=tuple(TIME_CASES), help="the time part's cases (default: all six)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case in the time part (the least counts)")
    parser.add_argument("--record", action="store_true", help="write the time part's figures to planner_times.json")
    parser.add_argument(
        "--against", metavar="TREE", type=Path, help="the time part side by side with TREE (a checkout of before)"
    )
    parser.add_argument("--workloads", type=int, default=20, help="random workloads of the optimality part")
    parser.add_argument(
        "--recompute",
        default="auto",
        choices=("auto", "off", "on"),
        help="the random workloads' recompute policy (optimality part)",
    )
    parser.add_argument(
        "--cached-bytecode",
        action="store_true",
        help="the time part's commands keep their compiled modules, as an installed package does (rounds >= 2)",
    )
    args = parser.parse_args()
    parts = args.part or ["time", "optimality", "quality"]
    env = cached_bytecode_env() if args.cached_bytecode else None
    warnings.simplefilter("error", SolverFallbackWarning)  # a fallback would make the figures meaningless
    tmp = Path(REPO / "runs" / "bench_planner")
    tmp.mkdir(parents=True, exist_ok=True)
    if "time" in parts and args.against:
        part_time_against(args.case or list(TIME_CASES), args.rounds, args.against.resolve(), env)
    elif "time" in parts:
        part_time(args.case or list(TIME_CASES), args.rounds, args.record, env)
    if "optimality" in parts:
        part_optimality(args.workloads, tmp, args.recompute)
    if "quality" in parts:
        part_quality()
    if "robust" in parts:
        part_robust(tmp)
    if "judge" in parts:
        part_judge()
    if "baselines" in parts:
        part_baselines(args.rounds)


if __name__ == "__main__":
    main()
