"""Where the planner's seconds go: ``lorafleet plan`` profiled, its CPU split by component, on one or more trees.

    .venv/bin/python benchmarks/profile_planner.py examples/lobra-70b.yaml --gpus 64
    .venv/bin/python benchmarks/profile_planner.py examples/service-64.yaml --tree /path/to/old/checkout --tree .
    .venv/bin/python benchmarks/profile_planner.py examples/service-128.yaml --plain-parts   # no cProfile

Each tree (a checkout of this repository; default: this one) runs the whole ``lorafleet plan``
command in a fresh process with that tree first on ``PYTHONPATH``, twice per round: once plain, for
its CPU seconds (the process and its CBC children), once under cProfile with a CPU clock, for the
components. The trees take turns round by round, so a busy machine slows every side alike.

The components are the inclusive CPU seconds of the functions named in :data:`COMPONENTS` (the same
names in the trees compared; a function a tree lacks reads 0). They nest (a step dispatched on a
sampled batch is bucketed, balanced, placed and priced), so they do not add up; cProfile slows
Python code more than numpy or CBC, so read them as shares of the profiled total. CBC runs in child
processes: its CPU is the "MILP solves (CBC processes)" row, outside the profile.

``--plain-parts`` replaces the profiled run by one with process-time timers around the functions of
:data:`PLAIN_PARTS` (every module's binding of each is replaced, so ``from x import f`` callers are timed too;
the outermost call of each only): the parts' plain CPU seconds, which cProfile distorts (it slows Python code
~2.5x more than numpy or CBC). They nest too (a balance inside the search).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMPONENTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("search (pool, judging, polish, trim)", (("search.py", "search"),)),
    ("  MILP model building (PuLP)", (("deployment_ilp.py", "build_model"),)),
    (
        "  deployments judged on the expected batch",
        (("evaluation.py", "evaluate"), ("evaluation.py", "evaluate_below"), ("search.py", "evaluate")),
    ),
    ("  of it, the polish (swapped deployments)", (("refine.py", "polished"),)),
    ("robust race (sampled batches)", (("driver.py", "robust_choice"), ("pipeline.py", "robust_choice"))),
    ("baselines", (("baselines.py", "baseline_schedules"),)),
    ("every dispatcher solve (solve_step)", (("step.py", "solve_step"),)),
    ("balance (water-fill, LP start, exchanges)", (("balance.py", "_balance"),)),
    ("  of it, the exchanges", (("balance.py", "_exchange_search"),)),
    ("LPs (HiGHS: balance starts, fluid bounds)", (("balance.py", "_min_max_lp"),)),
    ("MILP solves, PuLP's side (write, read)", (("solvers.py", "solve"),)),
    ("fluid LP bound (polish screen)", (("balance.py", "fluid_bound"),)),
    ("bucketing DP", (("bucketing.py", "optimal_buckets_by_count"),)),
    ("load models", (("load.py", "build_load_model"),)),
    ("placed step: place, cut, price", (("step.py", "placed_work"),)),
    ("  packing (first-fit decreasing)", (("microbatch.py", "packed_microbatches"),)),
    ("  replica pricing (cost model)", (("cost_model.py", "replica_time"),)),
    ("    pipeline-window stall (schedule timelines)", (("schedule.py", "stall_slots"),)),
)


PLAIN_PARTS: tuple[tuple[str, str, str], ...] = (
    ("the search (pool, judging, polish, trim)", "lorafleet.planner.search", "search"),
    ("  the polish (swapped deployments)", "lorafleet.planner.refine", "polished"),
    ("  the trim", "lorafleet.planner.refine", "trimmed"),
    ("robust race (sampled batches)", "lorafleet.planner.driver", "robust_choice"),
    ("baselines", "lorafleet.planner.baselines", "baseline_schedules"),
    ("MILP solves, PuLP's side (build, write, read)", "lorafleet.solvers", "solve"),
    ("dispatcher: balances", "lorafleet.dispatch.balance", "_balance"),
    ("dispatcher: pipelined packing (pp > 1)", "lorafleet.dispatch.pipelined", "pipelined_packing"),
    ("dispatcher: placing sequences", "lorafleet.dispatch.placement", "place_sequences"),
    ("dispatcher: load models", "lorafleet.dispatch.load", "build_load_model"),
    ("dispatcher: bucketing DP", "lorafleet.dispatch.bucketing", "optimal_buckets_by_count"),
    ("LPs (HiGHS in process)", "lorafleet.solvers", "solve_lp"),
    ("cost model: replica pricing", "lorafleet.costmodel.cost_model", "CostModel.replica_time"),
    ("cost model: adapter parameters (step overheads)", "lorafleet.costmodel.adapters", "AdapterLoad.params_per_layer"),
)
"""(label, module, function or Class.method) of ``--plain-parts``."""


def _timed_parts() -> dict[str, float]:
    """Wrap every :data:`PLAIN_PARTS` function in a process-time timer, wherever a loaded module binds it; the
    dict its timers add to."""
    import importlib

    import lorafleet.cli
    import lorafleet.commands.plan
    import lorafleet.planner.driver  # noqa: F401  (bind the planner's names before they are wrapped)

    totals: dict[str, float] = {}
    active: set[str] = set()
    for label, module_name, name in PLAIN_PARTS:
        owner: object = importlib.import_module(module_name)
        *classes, attr = name.split(".")
        for cls in classes:
            owner = getattr(owner, cls)
        original = getattr(owner, attr)

        def timed(*args, _f=original, _label=label, **kwargs):
            if _label in active:
                return _f(*args, **kwargs)
            active.add(_label)
            start = time.process_time()
            try:
                return _f(*args, **kwargs)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.process_time() - start
                active.discard(_label)

        setattr(owner, attr, timed)
        if not classes:
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("lorafleet") and getattr(module, attr, None) is original:
                    setattr(module, attr, timed)
    return totals


def cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the CBC solves)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def children_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def _child(argv: list[str], profile: bool, parts: bool = False) -> dict:
    """Run ``lorafleet plan`` in this process (the tree is on sys.path): its CPU, and its profile or (``parts``)
    its parts' plain CPU."""
    from lorafleet.cli import main

    totals = _timed_parts() if parts else None
    start, kids = cpu_seconds(), children_cpu()
    out = io.StringIO()
    profiler = cProfile.Profile(time.process_time) if profile else None
    with redirect_stdout(out):
        if profiler is not None:
            profiler.enable()
        main(["plan", *argv])
        if profiler is not None:
            profiler.disable()
    result = {"cpu_s": cpu_seconds() - start, "cbc_s": children_cpu() - kids}
    if totals is not None:
        result["components"] = {label: totals.get(label, 0.0) for label, _, _ in PLAIN_PARTS}
        result["profiled_s"] = result["cpu_s"]
    if profiler is None:
        return result
    stats = pstats.Stats(profiler).stats
    totals = {}
    for label, functions in COMPONENTS:
        totals[label] = sum(
            cum for (path, _, name), (_, _, _, cum, _) in stats.items() if (Path(path).name, name) in functions
        )
    result["components"] = totals
    result["profiled_s"] = sum(tt for (_, _, tt, _, _) in stats.values())
    return result


def _run_tree(tree: Path, argv: list[str], profile: bool, parts: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import profile_planner as p; "
        "print(json.dumps(p._child(sys.argv[3:], sys.argv[2] == 'profile', sys.argv[2] == 'parts')))"
    )
    how = "parts" if parts else "profile" if profile else "plain"
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), how, *argv],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", help="workload YAML (relative to each tree)")
    parser.add_argument("--gpus", help="passed to lorafleet plan")
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to profile (repeat to compare)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of plain + profiled runs per tree")
    parser.add_argument(
        "--plain-parts", action="store_true", help="time PLAIN_PARTS with process-time timers instead of cProfile"
    )
    args = parser.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    argv = [str(Path(args.workload).resolve()), *(["--gpus", args.gpus] if args.gpus else [])]
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            plain = _run_tree(tree, argv, profile=False)
            profiled = _run_tree(tree, argv, profile=not args.plain_parts, parts=args.plain_parts)
            runs[tree].append({**profiled, "cpu_s": plain["cpu_s"], "cbc_s": plain["cbc_s"]})
    load = os.getloadavg()[0]
    print(f"lorafleet plan {' '.join(argv)}: CPU seconds, median of {args.rounds} round(s); load {load:.1f}")
    names = [t.name for t in trees]
    print(f"{'':48}" + "".join(f"{n[-14:]:>16}" for n in names))

    def median(tree: Path, key) -> float:
        values = sorted(key(r) for r in runs[tree])
        return values[len(values) // 2]

    rows = [
        ("whole command (plain run)", lambda r: r["cpu_s"]),
        ("  MILP solves (CBC processes)", lambda r: r["cbc_s"]),
        (
            "timed run (plain, with the timers)" if args.plain_parts else "profiled total (cProfile, CPU clock)",
            lambda r: r["profiled_s"],
        ),
    ]
    labels = [label for label, *_ in (PLAIN_PARTS if args.plain_parts else COMPONENTS)]
    rows += [(label, lambda r, label=label: r["components"][label]) for label in labels]
    for label, key in rows:
        print(f"{label:48}" + "".join(f"{median(t, key):>16.2f}" for t in trees))


if __name__ == "__main__":
    main()
