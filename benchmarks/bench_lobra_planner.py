"""LobRA's own deployment planner against ``lorafleet plan``, side by side on this machine, in one script.

    .venv/bin/python benchmarks/bench_lobra_planner.py --hetu /tmp/peer/examples/lobra \\
        --python /tmp/peer/venv/bin/python [--rounds 3] [--sides lobra lobra+tp4] [--with-buckets] [--as-shipped]
        [--lorafleet-sides lorafleet lorafleet:lobra-configs lorafleet:unpipelined]

Both sides plan LobRA's 7B experiment (6 tasks: dolly, Evol-Instruct, XSum, CommitPackFT, MeetingBank,
python_code; Llama2-7B on 16 x A100-40GB), each in a fresh process, the sides taking turns round by round
(a busy machine slows both alike), each keeping its compiled bytecode from the second round on
(``bench_planner.cached_bytecode_env``):

- **lorafleet**: the whole ``lorafleet plan examples/lobra-7b.yaml`` command (``bench_planner.plan_command_cpu``:
  the process and its CBC solves), on every config of its analytic A100-40GB model; and (:data:`LORAFLEET_SIDES`)
  the same command on LobRA's config space, the model's profile (``profiles/llama2-7b-a100-40gb-analytic.json``)
  cut to the (tp, pp) rows of LobRA's max-token table without recomputation and given as ``--profile``, and on those
  rows without pipelines (pp 1: TP 1, 2, 4, 8, the pool LobRA's TP 4 side proposes from that space);
- **LobRA**: its static deployment planner, ``PruneStaticPlanner`` from PKU-DAIR/Hetu ``examples/lobra``
  (``trainer/planner.py``: configuration proposal, every plan of the pool's configs summing to 16 GPUs, the
  lower-bound pruning at 15 %, one SCIP MILP per surviving plan through joblib, ``limits/gap`` 0.5 %,
  ``limits/stallnodes`` 5000), on LobRA's cost data (``../shared/reference/lobra_a100_40gb_llama2_7b_*.csv``:
  its profiled per-layer times, fitted by its own ``CostModel`` with ``curve_fit``, and its max-token table), fed
  the workload's length distributions as ``scripts/deploy_strategy_plan.py`` feeds it a dataset's.

Measured: CPU seconds (``resource.getrusage``, user + system, of the process and its children: joblib's workers and
CBC count; LobRA's joblib runs its ``len(plans) // 64`` = 0 -> 1 job in process) and wall seconds, the least of
``--rounds`` a side. Each LobRA side (glue 3) is reported twice: its whole process (interpreter, imports, the cost
model's fit, the planner), the figure set against ``lorafleet plan``'s whole command, and ``schedule()`` alone (the
planner's own call, measured inside the process). The ratios printed are LobRA's / each lorafleet side's. LobRA's
padding-minimising bucket DP (``trainer/utils/dp_bucket.pyx``, 16 buckets over ``GBS x 100`` copies of the batch,
``BUCKET_PLAN=DYNAMIC``) picks the bucket boundaries its planner plans on; it runs once, first, in a process of its
own, and its boundaries are handed to every timed LobRA run. Its CPU seconds are printed apart and, with
``--with-buckets``, measured in every round and added to LobRA's side (lorafleet needs no such step: its plan works
on the lengths).

**Setting LobRA up** (nothing of it is vendored here)::

    git -C <a clone of PKU-DAIR/Hetu> archive HEAD examples/lobra | tar -x -C /tmp/peer/
    python3.11 -m venv /tmp/peer/venv
    /tmp/peer/venv/bin/pip install numpy scipy pyscipopt joblib cython setuptools
    cd /tmp/peer/examples/lobra && /tmp/peer/venv/bin/python setup.py build_ext --inplace   # its two .pyx modules

Measured with PySCIPOpt 6.3 (SCIP 10) on CPython 3.11; LobRA shipped SCIP 8.1. Its SCIP thread settings are
commented out in its code, so SCIP runs one thread on both versions.

**The glue** (what this script does around LobRA's code; its planner's algorithm runs unchanged):

1. Hetu's GPU runtime is not imported: the packages ``trainer``, ``trainer.utils``, ``profiler`` and ``utils``,
   whose ``__init__`` files import Hetu (``hetu``, the trainer, the data loader), are registered as bare packages
   on LobRA's folders, so that ``trainer/planner.py``, ``profiler/cost_model.py``, ``utils/logger.py`` and the
   two compiled modules import as they are. The planner itself imports only numpy, joblib and pyscipopt.
2. ``PruneStaticPlanner.schedule`` calls two methods that Hetu's ``planner.py`` (HEAD 9e47240, 2025-07-18) does not
   define: ``get_estimated_time(mbs, s, tp, pp)`` and ``get_estimate_total_time(tp, pp, dispatch, i)`` (LobRA's
   earlier artefact had both). They are bound to the file's own equivalents: ``get_estimated_batch_time`` (the
   same formula: 0 for no sequences, else ``t_tp(b, s) * L / pp``) and ``print_dispatch_detail`` (Eq. 10-12 of
   a replica's time under the group dispatch, with ``ceil(d / dp)`` sequences a replica), its printing discarded.
3. The cost data: LobRA's ``CostModel`` fits one curve per TP degree found in the time profile, and
   ``get_strategy_candidates`` cannot price a (tp, pp) of another (``popt[4]`` is None). The reference profile
   holds TP 1, 2 and 8 (TP 4, profiled in LobRA's artefact, is held out on purpose, to test lorafleet's model), so
   two LobRA sides run: ``lobra``, the reference profile, with the max-token table cut to the (tp, pp) rows of its
   TP degrees (its pool: ``<1,1>``, ``<2,1>``, ``<8,1>``, ``<2,8>``; 6 plans to solve); and ``lobra+tp4``, the same
   profile plus TP 4 rows on the (s, b) grid of its TP 2 rows, t(b, s) from lorafleet's analytic A100-40GB model of
   the workload's block (within 4 % of the reference at TP 2, median), the whole table kept: the config space
   LobRA planned on (its pool adds ``<4,1>``; 8 plans of 10 survive the pruning).
4. The lengths: each task's length distribution (``lorafleet.workload``: the preset's distribution, truncated to
   the task's context) stands in for LobRA's tokenised dataset. ``deploy_strategy_plan.py``'s steps follow on it:
   lengths aligned up to 16 tokens, ``round(p x GBS x 100)`` copies of each per task, the bucket DP
   (``get_buckets_dp``, 16 buckets), then each task's probabilities re-binned to those buckets (``bisect_left``, as
   ``get_length_distribution`` does) and ``schedule`` called on them with the tasks' global batch sizes.
5. ``schedule`` ends, after its search, in a loop printing the single-config plans among the solved; its call
   ``get_lower_bound_from_group_planner(i, multi_strategy)`` passes two arguments to a local function of one, so it
   raises TypeError whenever ``<8,1> x 2`` is among the plans solved (on the ``lobra`` side it is). Only that
   TypeError is caught; the search is over by then (its CPU seconds are counted), and the plan is the one
   ``schedule`` returns next: the least objective of its MILPs (read from the solved SCIP models, the first of
   equals).
6. Each plan's MILP prices its configs through ``estimate_scheme_time``, which takes a config's (tp, pp) from
   ``self.scheme_pool[j]`` with ``j`` the config's index *within the plan*, not in the pool: a plan of the pool's
   configs 1 and 2 is priced as if it held configs 0 and 1, its full micro-batches' times then missing from the
   cache (0 ms). As shipped, LobRA picks ``<2,1> x 4 + <8,1> x 1`` at a claimed 1.86 s (priced right: 12.94 s).
   So each MILP is built with ``scheme_pool`` holding the plan's own configs in its order (restored after the
   build; nothing else reads it there); ``--as-shipped`` keeps the bug. The earlier measurement's plan
   (``<1,1> x 4 + <2,1> x 2 + <8,1> x 1``) is the corrected one's.

This file runs in two interpreters: the driver in lorafleet's venv, and ``--lobra-side`` (LobRA's side, one
process a run) in the venv given by ``--python``, where lorafleet is not installed, so its module-level imports
are the standard library's alone.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import csv
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"
TIME_PROFILE = REFERENCE / "lobra_a100_40gb_llama2_7b_layer_time.csv"
MAX_TOKENS = REFERENCE / "lobra_a100_40gb_llama2_7b_max_tokens.csv"
WORKLOAD = "examples/lobra-7b.yaml"
NUM_LAYERS = 32
"""Llama2-7B's transformer layers (``deploy_strategy_plan.sh``'s 7B settings)."""
BUCKET_NUM = 16
"""``deploy_strategy_plan.sh``'s default ``BUCKET_NUM``."""
ALIGNMENT = 16
"""``deploy_strategy_plan.py``'s alignment of the fine-grained bucket candidates."""
HETU_PACKAGES = ("utils", "profiler", "trainer", "trainer.utils")
"""LobRA's packages whose ``__init__`` imports Hetu's runtime: registered bare (glue 1)."""


def cpu_now() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# ---------------------------------------------------------------- LobRA's side (runs in the --python venv)


def import_lobra(hetu: Path) -> types.SimpleNamespace:
    """LobRA's cost model, static planner and bucket DP, imported from ``hetu`` without Hetu's runtime (glue 1)."""
    sys.path.insert(0, str(hetu))
    for name in HETU_PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(hetu / name.replace(".", "/"))]
        sys.modules[name] = package
    from profiler.cost_model import CostModel
    from trainer.planner import PruneStaticPlanner
    from trainer.utils.dp_bucket import get_buckets_dp

    return types.SimpleNamespace(CostModel=CostModel, PruneStaticPlanner=PruneStaticPlanner, dp=get_buckets_dp)


def profiled_max_tokens(time_profile: Path, scratch: Path) -> Path:
    """The max-token table restricted to the TP degrees ``time_profile`` has (glue 3), written under ``scratch``."""
    with time_profile.open() as f:
        profiled = {line.split(",", 1)[0] for line in list(f)[1:]}
    lines = MAX_TOKENS.read_text().splitlines()
    kept = [lines[0]] + [line for line in lines[1:] if line.split(",", 1)[0] in profiled]
    path = scratch / "max_tokens.csv"
    path.write_text("\n".join(kept) + "\n")
    return path


def aligned(length: int) -> int:
    """A length rounded up to the alignment of LobRA's fine-grained buckets."""
    return (length + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def lobra_buckets(lobra: types.SimpleNamespace, tasks: list[dict]) -> list[int]:
    """``deploy_strategy_plan.py``'s ``BUCKET_PLAN=DYNAMIC`` boundaries (glue 4): every task's aligned lengths as
    candidates, ``round(p x GBS x 100)`` copies of each per task (the longest added once if it rounded away), and
    LobRA's padding-minimising DP over their sorted list, ``BUCKET_NUM`` buckets at most."""
    import numpy as np

    fine = [{} for _ in tasks]
    for dist, task in zip(fine, tasks):
        for length, p in zip(task["lengths"], task["probs"]):
            if p > 0:
                dist[aligned(length)] = dist.get(aligned(length), 0.0) + p
    candidates = sorted(set().union(*fine))
    longest = max(max(dist) for dist in fine)
    merged: list[int] = []
    for dist, task in zip(fine, tasks):
        for length, p in dist.items():
            merged.extend([length] * round(p * task["batch_size"] * 100))
    if longest not in merged:
        merged.append(longest)
    return [
        int(b) for b in lobra.dp(np.array(sorted(merged), dtype=np.int32), np.array(candidates, np.int32), BUCKET_NUM)
    ]


def rebinned(task: dict, buckets: list[int]) -> dict[int, float]:
    """A task's length probabilities summed into LobRA's buckets: a length goes to the first bucket >= it."""
    dist: dict[int, float] = {}
    for length, p in zip(task["lengths"], task["probs"]):
        if p > 0:
            bucket = buckets[bisect.bisect_left(buckets, length)]
            dist[bucket] = dist.get(bucket, 0.0) + p
    return dist


def bind_missing_methods(planner: object) -> None:
    """Glue 2: the two methods ``schedule`` calls but Hetu's ``planner.py`` lacks, bound to its own equivalents."""
    planner.get_estimated_time = planner.get_estimated_batch_time

    def get_estimate_total_time(tp: int, pp: int, dispatch: dict, strategy_id: int) -> float:
        with contextlib.redirect_stdout(io.StringIO()):
            return planner.print_dispatch_detail(
                planner.dps[strategy_id], tp, pp, planner.max_tokens_list[strategy_id], dispatch, strategy_id
            )

    planner.get_estimate_total_time = get_estimate_total_time


def record_milps(planner: object, as_shipped: bool) -> list[dict]:
    """Every MILP the planner builds, kept with the plan it prices, read after ``schedule`` (objective, status);
    unless ``as_shipped``, each built with the plan's own configs at its local indices (glue 6)."""
    built: list[dict] = []
    build = planner.build_planner
    pool = planner.scheme_pool

    def recorded(seq_distribution: dict) -> object:
        if not as_shipped:
            planner.scheme_pool = [
                (tp * pp, (tp, pp), m) for tp, pp, m in zip(planner.tps, planner.pps, planner.max_tokens_list)
            ]
        try:
            model = build(seq_distribution)
        finally:
            planner.scheme_pool = pool
        built.append({"tp": list(planner.tps), "pp": list(planner.pps), "dp": list(planner.dps), "model": model})
        return model

    planner.build_planner = recorded
    return built


def lobra_side(hetu: Path, spec: Path, out: Path) -> None:
    """One LobRA run: the bucket DP alone when ``spec`` has no buckets, else the planner on them; ``out`` gets the
    figures measured inside this process and the plan."""
    started = cpu_now()
    lobra = import_lobra(hetu)
    inputs = json.loads(spec.read_text())
    tasks = inputs["tasks"]
    if inputs.get("buckets") is None:
        cpu, wall = cpu_now(), time.perf_counter()
        buckets = lobra_buckets(lobra, tasks)
        out.write_text(json.dumps({"buckets": buckets, "cpu": cpu_now() - cpu, "wall": time.perf_counter() - wall}))
        return
    with tempfile.TemporaryDirectory() as scratch:
        config = types.SimpleNamespace(n_layer=NUM_LAYERS)  # CostModel keeps its model config and reads nothing of it
        time_profile = Path(inputs["time_profile"])
        cost_model = lobra.CostModel(config, str(time_profile), str(profiled_max_tokens(time_profile, Path(scratch))))
    planner = lobra.PruneStaticPlanner(
        cost_model,
        NUM_LAYERS,
        len(tasks),
        [task["batch_size"] for task in tasks],
        inputs["ngpus"],
        cost_model.get_strategy_candidates(NUM_LAYERS),
        use_optimized_scheme_pool=True,
    )
    bind_missing_methods(planner)
    milps = record_milps(planner, inputs["as_shipped"])
    distributions = [rebinned(task, inputs["buckets"]) for task in tasks]
    cpu, wall = cpu_now(), time.perf_counter()
    try:
        strategy, _ = planner.schedule(distributions)
        crashed = None
    except TypeError as error:  # glue 5: the report loop after the search, see the module docstring
        if "get_lower_bound_from_group_planner" not in str(error):
            raise
        strategy, crashed = None, str(error)
    schedule_cpu, schedule_wall = cpu_now() - cpu, time.perf_counter() - wall
    solved = [
        {"plan": list(zip(m["tp"], m["pp"], m["dp"])), "status": m["model"].getStatus(), "ms": m["model"].getObjVal()}
        for m in milps
        if m["model"].getNSols() > 0
    ]
    if strategy is None:  # schedule's pick: the least objective, the first of equals (its argsort on <= 8 plans)
        best = min(solved, key=lambda m: m["ms"])["plan"]
    else:
        best = [(*planner.scheme_pool[i][1], dp) for i, dp in strategy.items()]
    plan = sorted(best, key=lambda c: (c[0] * c[1], c))
    out.write_text(
        json.dumps(
            {
                "plan": plan,
                "schedule_cpu": schedule_cpu,
                "schedule_wall": schedule_wall,
                "process_cpu_inside": cpu_now() - started,
                "pool": [list(scheme[1]) + [scheme[2]] for scheme in planner.scheme_pool],
                "milps": len(milps),
                "crashed": crashed,
                "solved": solved,
            }
        )
    )


# ---------------------------------------------------------------- the driver (lorafleet's venv)


def workload_spec(ngpus: int, as_shipped: bool) -> dict:
    """The workload's tasks as LobRA's planner is fed them: each one's length distribution and global batch."""
    from lorafleet.workload import load_workload

    workload = load_workload(REPO / WORKLOAD)
    tasks = [
        {
            "name": task.name,
            "batch_size": int(task.batch_size),
            "lengths": [int(x) for x in task.lengths.lengths],
            "probs": [float(p) for p in task.lengths.probs],
        }
        for task in workload.tasks
    ]
    return {"tasks": tasks, "ngpus": ngpus, "as_shipped": as_shipped, "time_profile": str(TIME_PROFILE)}


def with_analytic_tp4(scratch: Path) -> Path:
    """The reference time profile plus TP 4 rows (``--sides``' ``lobra+tp4``): lorafleet's analytic A100-40GB
    t(b, s) of the workload's block at TP 4, on the (s, b) grid of the profile's TP 2 rows, written under
    ``scratch``. LobRA profiled TP 4 (27 rows in its artefact); the reference holds them out."""
    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.costmodel.time_model import MicroBatchShape
    from lorafleet.workload import load_workload

    workload = load_workload(REPO / WORKLOAD)
    tp4 = workload_cost_model(workload, workload_cluster(workload)).layer_time[4]
    lines = TIME_PROFILE.read_text().splitlines()
    grid = [(int(s), int(b)) for tp, s, b, _ in (line.split(",") for line in lines[1:]) if tp == "2"]
    added = [f"4,{s},{b},{tp4.shape(MicroBatchShape.padded(b, s))!r}" for s, b in grid]
    path = scratch / "layer_time_with_tp4.csv"
    path.write_text("\n".join(lines + added) + "\n")
    return path


def run_lobra(python: str, hetu: Path, spec: Path, env: dict[str, str]) -> tuple[float, float, dict]:
    """One LobRA process: its CPU seconds (process + children, measured from here), wall seconds, its report."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out.json"
        argv = [
            python,
            str(Path(__file__).resolve()),
            "--lobra-side",
            str(spec),
            "--hetu",
            str(hetu),
            "--out",
            str(out),
        ]
        before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(argv, cwd=hetu, env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - wall
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        report = json.loads(out.read_text())
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu, wall, report


def run_lorafleet(env: dict[str, str], argv: list[str]) -> tuple[float, float, str]:
    """One ``lorafleet plan`` command with the extra arguments ``argv``: CPU seconds, wall seconds, its timing
    line."""
    from bench_planner import plan_command_cpu

    wall = time.perf_counter()
    cpu, laps, _ = plan_command_cpu([WORKLOAD, *argv], env=env)
    return cpu, time.perf_counter() - wall, laps


def lorafleet_plan(env: dict[str, str], argv: list[str]) -> str:
    """lorafleet's chosen deployment for the workload (with the extra arguments ``argv``), ``<tp,pp> x n + ...``,
    from its plan JSON."""
    with tempfile.TemporaryDirectory() as scratch:
        written = Path(scratch) / "plan.json"
        subprocess.run(
            [sys.executable, "-m", "lorafleet", "plan", WORKLOAD, *argv, "--json", str(written)],
            cwd=REPO,
            env=env,
            check=True,
            capture_output=True,
        )
        plan = json.loads(written.read_text())
    return plan_summary(plan)


def plan_summary(plan: dict) -> str:
    """``<tp,pp> x n + ...`` of a plan JSON's replicas (configs named ``tp<T>_pp<P>``), smallest first."""
    counts: dict[tuple[int, int], int] = {}
    for replica in plan["replicas"]:
        tp, pp = (int(part[2:]) for part in replica["config"].split("_")[:2])
        counts[tp, pp] = counts.get((tp, pp), 0) + 1
    return deployment(sorted((tp, pp, n) for (tp, pp), n in counts.items()))


def deployment(configs: list) -> str:
    """``<tp,pp> x n + ...`` of (tp, pp, n) triples, fewest GPUs a replica first."""
    ordered = sorted(configs, key=lambda c: (c[0] * c[1], tuple(c)))
    return " + ".join(f"<{tp},{pp}> x {n}" for tp, pp, n in ordered)


def uptime() -> str:
    """The 1-, 5- and 15-minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


LOBRA_SIDES = {"lobra": "LobRA, reference data (TP 1, 2, 8)", "lobra+tp4": "LobRA, TP 4 analytic"}
"""LobRA's sides: its planner on the reference profile, and on it with TP 4's rows from lorafleet's model."""
LORAFLEET_SIDES = {
    "lorafleet": "lorafleet plan " + WORKLOAD,
    "lorafleet:lobra-configs": "lorafleet, LobRA's (tp, pp) rows",
    "lorafleet:unpipelined": "lorafleet, LobRA's rows of pp 1",
}
"""lorafleet's sides: every config of its model; the (tp, pp) rows of LobRA's max-token table (no recomputation);
those of them without pipelines (:func:`lorafleet_arguments`)."""
ANALYTIC_PROFILE = REPO / "profiles" / "llama2-7b-a100-40gb-analytic.json"
"""The profile of lorafleet's analytic A100-40GB model of Llama2-7B: the workload's default cost model."""


def lorafleet_arguments(scratch: Path) -> dict[str, list[str]]:
    """Each lorafleet side's extra ``plan`` arguments: none, or ``--profile`` of :data:`ANALYTIC_PROFILE` with its
    memory records (a config is planned on when it has one) cut to the side's configs, written under ``scratch``."""
    with MAX_TOKENS.open() as f:
        rows = {(int(row["tp"]), int(row["pp"])) for row in csv.DictReader(f)}
    configs = {"lorafleet:lobra-configs": rows, "lorafleet:unpipelined": {(tp, pp) for tp, pp in rows if pp == 1}}
    profile = json.loads(ANALYTIC_PROFILE.read_text())
    argv: dict[str, list[str]] = {"lorafleet": []}
    for side, kept in configs.items():
        memory = [m for m in profile["memory"] if (m["tp"], m["pp"]) in kept and not m["recompute"]]
        path = scratch / f"{side.partition(':')[2]}.json"
        path.write_text(json.dumps(profile | {"memory": memory}))
        argv[side] = ["--profile", str(path)]
    return argv


def lobra_specs(args: argparse.Namespace, hetu: Path, scratch: Path, env: dict[str, str]) -> dict[str, Path]:
    """Each side's input for LobRA's planner, with the boundaries of LobRA's bucket DP (run once, printed), and
    ``buckets``: the DP's own input."""
    spec = workload_spec(args.ngpus, args.as_shipped)
    specs = {"buckets": scratch / "buckets.json"}
    specs["buckets"].write_text(json.dumps(spec))
    cpu, wall, dp = run_lobra(args.python, hetu, specs["buckets"], env)
    print(
        f"LobRA's bucket DP ({BUCKET_NUM} buckets): {dp['cpu']:.2f} CPU s inside, {cpu:.2f} CPU s and {wall:.2f} s "
        f"wall for its process; buckets {dp['buckets']}  (load {uptime()})"
    )
    for side in args.sides:
        profile = TIME_PROFILE if side == "lobra" else with_analytic_tp4(scratch)
        specs[side] = scratch / f"{side}.json"
        specs[side].write_text(json.dumps(spec | {"buckets": dp["buckets"], "time_profile": str(profile)}))
    return specs


def take_turns(
    args: argparse.Namespace, hetu: Path, specs: dict[str, Path], ours: dict[str, list[str]], env: dict[str, str]
) -> dict:
    """``--rounds`` rounds, the order of the sides rotating each round: every run's (CPU s, wall s, report) per
    side (``ours``: each lorafleet side's extra arguments), and the load after each."""
    sides = [*ours, *args.sides] + (["buckets"] if args.with_buckets else [])
    runs: dict[str, list] = {side: [] for side in [*sides, "load"]}
    for r in range(args.rounds):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            runs[side].append(
                run_lorafleet(env, ours[side]) if side in ours else run_lobra(args.python, hetu, specs[side], env)
            )
            runs["load"].append(uptime())
        line = ", ".join(f"{side} {runs[side][-1][0]:.2f} CPU s / {runs[side][-1][1]:.2f} s" for side in sides)
        print(f"round {r + 1}: {line}; load {runs['load'][-1]}")
    return runs


def report(runs: dict, sides: list[str], ours: dict[str, list[str]], env: dict[str, str]) -> None:
    """The least of each side's runs, the ratios LobRA / lorafleet (against each lorafleet side, in the order
    listed), and the plans each found."""
    least = {side: min(runs[side], key=lambda run: run[0]) for side in [*ours, *sides]}

    def ratios(cpu: float) -> str:
        return " / ".join(f"{cpu / least[side][0]:.2f}x" for side in ours)

    rounds = len(runs[next(iter(ours))])
    print(f"\nleast of {rounds} a side, CPU seconds (wall seconds); ratio to each lorafleet side's CPU s, in order:")
    for side in ours:
        print(f"  {LORAFLEET_SIDES[side]:<52} {least[side][0]:6.2f} ({min(r[1] for r in runs[side]):.2f})")
    for side in sides:
        process = least[side][0]
        schedule = min(run[2]["schedule_cpu"] for run in runs[side])
        wall = min(run[2]["schedule_wall"] for run in runs[side])
        print(
            f"  {LOBRA_SIDES[side] + ', process':<52} {process:6.2f} ({min(r[1] for r in runs[side]):.2f})  "
            f"{ratios(process)}"
        )
        print(f"  {LOBRA_SIDES[side] + ', schedule() alone':<52} {schedule:6.2f} ({wall:.2f})  {ratios(schedule)}")
        if runs.get("buckets"):
            both = process + min(run[0] for run in runs["buckets"])
            print(f"  {'  with the bucket DP process':<52} {both:6.2f}  {ratios(both)}")
    for side in sides:
        lobra = least[side][2]
        print(f"\n{LOBRA_SIDES[side]}: config pool (tp, pp, max tokens) {lobra['pool']}")
        print(f"  {lobra['milps']} MILPs built, {len(lobra['solved'])} solved; the best five:")
        for milp in sorted(lobra["solved"], key=lambda m: m["ms"])[:5]:
            print(f"    {deployment(milp['plan'])}: {milp['ms'] / 1000:.3f} s ({milp['status']})")
        if lobra["crashed"]:
            print(f"  schedule() raised after its search (glue 5): {lobra['crashed']}")
        print(f"  plan: {deployment(lobra['plan'])}")
    print()
    for side, argv in ours.items():
        print(f"{LORAFLEET_SIDES[side]}: {lorafleet_plan(env, argv)}  (lorafleet's analytic A100-40GB model)")
    print(f"load (1, 5, 15 min) after each run: {'; '.join(runs['load'])}")


def input_problem(args: argparse.Namespace, hetu: Path) -> str | None:
    """One line naming the argument that is wrong, or None."""
    if not (hetu / "trainer" / "planner.py").is_file():
        return f"--hetu {args.hetu}: no trainer/planner.py (extract PKU-DAIR/Hetu's examples/lobra there)"
    if not list((hetu / "trainer" / "utils").glob("dp_bucket*.so")):
        return f"--hetu {args.hetu}: LobRA's Cython modules are not built (setup.py build_ext --inplace there)"
    if not args.python:
        return "--python: give the interpreter of LobRA's venv (see this script's docstring)"
    if args.rounds < 1:
        return f"--rounds {args.rounds}: at least 1"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hetu", type=Path, required=True, help="an extracted examples/lobra of PKU-DAIR/Hetu, built")
    parser.add_argument("--python", help="the interpreter of the venv that runs LobRA's planner (driver only)")
    parser.add_argument("--rounds", type=int, default=3, help="runs a side, taking turns (the least counts)")
    parser.add_argument("--ngpus", type=int, default=16, help="GPUs LobRA plans for (the workload's cluster: 16)")
    parser.add_argument("--with-buckets", action="store_true", help="LobRA's bucket DP timed in every round too")
    parser.add_argument(
        "--sides", nargs="+", choices=tuple(LOBRA_SIDES), default=list(LOBRA_SIDES), help="LobRA's sides run"
    )
    parser.add_argument(
        "--lorafleet-sides",
        nargs="+",
        choices=tuple(LORAFLEET_SIDES),
        default=list(LORAFLEET_SIDES),
        help="lorafleet's sides run (the first is the one LobRA's sides are set against first)",
    )
    parser.add_argument(
        "--as-shipped",
        action="store_true",
        help="LobRA's MILPs as its code builds them, its indexing bug kept (glue 6)",
    )
    parser.add_argument("--lobra-side", type=Path, metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    hetu = args.hetu.resolve()
    if args.lobra_side:
        lobra_side(hetu, args.lobra_side, args.out)
        return
    problem = input_problem(args, hetu)
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_planner import cached_bytecode_env

    env = cached_bytecode_env()
    with tempfile.TemporaryDirectory() as scratch:
        specs = lobra_specs(args, hetu, Path(scratch), env)
        arguments = lorafleet_arguments(Path(scratch))
        ours = {side: arguments[side] for side in args.lorafleet_sides}
        report(take_turns(args, hetu, specs, ours, env), args.sides, ours, env)


if __name__ == "__main__":
    main()
