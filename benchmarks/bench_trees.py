"""The hot paths of two checkouts side by side: whether a change of the code moved any of them.

    .venv/bin/python benchmarks/bench_trees.py --before /path/to/old/checkout [--rounds 3] [--only plan]

Each figure is measured in a process of each tree (``PYTHONPATH`` set to the tree, so ``python -m lorafleet`` and
``import lorafleet`` are that tree's; the same interpreter and packages), the trees taking turns within a round
(each first in turn); the least of the rounds and their median are kept (on a machine whose speed wanders, the
least is the steadier), and the ratios are this tree's over the other's (below 1: faster now):

- **plan**: ``lorafleet plan examples/lobra-70b.yaml --gpus 64``, CPU seconds of the process and its CBC solves;
- **dispatch**: one sampled batch of LobRA's 7B workload dispatched on its plan (``dispatch.dispatch_step``), CPU
  milliseconds, the median of 30 batches in one process;
- **demo step**: ``lorafleet train examples/demo/workload.yaml`` (SmolLM2-135M, CPU, one rank) for 3 steps, the
  median makespan of its steps 1 and 2 (``metrics.jsonl``; step 0 pays its warm-up);
- **queued add**: ``benchmarks/bench_queue.py``'s kept scenario (tiny-llama on one rank, ``codegen`` added at
  step 3): the boundary's cost of the add, from the end of step 2 to the start of step 3 (``bench_queue.run``).

Each tree writes its own plans (a plan file's schema may differ between the trees).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DISPATCH = """
import resource, statistics, sys
from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.dispatch import dispatch_step
from lorafleet.planner import PlannerOptions, plan_deployment
from lorafleet.sampling import sample_global_batch
from lorafleet.workload import load_workload

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

workload = load_workload("examples/lobra-7b.yaml")
cluster = workload_cluster(workload)
cost_model = workload_cost_model(workload, cluster, None)
plan = plan_deployment(workload, cluster, cost_model, PlannerOptions(robust_samples=0, baselines=False)).plan
spent = []
for step in range(31):
    batch = sample_global_batch(workload, step, seed=0)
    start = cpu()
    dispatch_step(batch, plan, cost_model)
    spent.append(cpu() - start)
print(statistics.median(spent[1:]) * 1e3)
"""

KEPT_PLAN = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from bench_queue import KEPT, write_plan
print(write_plan(Path(sys.argv[2]), KEPT))
"""


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def _run(tree: Path, argv: list[str], cwd: Path) -> str:
    done = subprocess.run(argv, cwd=cwd, env=_env(tree), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def plan_cpu_s(tree: Path, tmp: Path) -> float:
    before = _children_cpu()
    _run(tree, [sys.executable, "-m", "lorafleet", "plan", "examples/lobra-70b.yaml", "--gpus", "64"], tree)
    return _children_cpu() - before


def dispatch_ms(tree: Path, tmp: Path) -> float:
    return float(_run(tree, [sys.executable, "-c", DISPATCH], tree).split()[-1])


def demo_step_s(tree: Path, tmp: Path) -> float:
    out = tmp / f"demo-{abs(hash(str(tree)))}"
    plan = out / "plan.json"
    out.mkdir(parents=True, exist_ok=True)
    lorafleet = [sys.executable, "-m", "lorafleet"]
    _run(tree, [*lorafleet, "plan", "examples/demo/workload.yaml", "--gpus", "1", "--gpu", "cpu", "--json", str(plan)],
         tree)  # fmt: skip
    _run(tree, [*lorafleet, "train", "examples/demo/workload.yaml", "--gpus", "1", "--gpu", "cpu", "--plan",
                str(plan), "--steps", "3", "--out", str(out / "run"), "--overwrite", "--no-progress"],
         tree)  # fmt: skip
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["makespan_s"] for r in rows if r["step"] >= 1)


def queued_add_s(tree: Path, tmp: Path) -> float:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_queue import KEPT, run, write_workload

    from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer

    root = Path(tempfile.mkdtemp(dir=tmp))
    workload = write_workload(root, build_tiny_tokenizer(root / "tokenizer"), KEPT)
    plan = Path(_run(tree, [sys.executable, "-c", KEPT_PLAN, str(tree), str(workload)], root).split()[-1])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)  # bench_queue.run starts ``python -m lorafleet`` with this environment
    try:
        gaps, _, _ = run(workload, plan, root / "out", KEPT, relaunch=False)
    finally:
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.update(PYTHONPATH=saved)
    return gaps[3]


FIGURES: dict[str, tuple[str, Callable[[Path, Path], float]]] = {
    "plan": ("plan, LobRA 70B on 64 GPUs (CPU s)", plan_cpu_s),
    "dispatch": ("dispatch, LobRA 7B batch (CPU ms, median of 30)", dispatch_ms),
    "demo": ("demo step, SmolLM2-135M on CPU (s, median of steps 1-2)", demo_step_s),
    "queue": ("queued add at its boundary, tiny-llama (s)", queued_add_s),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", action="append", choices=tuple(FIGURES), help="these figures only")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "now": REPO}
    chosen = args.only or list(FIGURES)
    values: dict[str, dict[str, list[float]]] = {f: {t: [] for t in trees} for f in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for figure in chosen:
                order = list(trees) if k % 2 == 0 else list(reversed(trees))  # each tree first in turn
                for tree in order:
                    values[figure][tree].append(FIGURES[figure][1](trees[tree], Path(tmp)))
                print(f"round {k + 1}: {figure} {values[figure]}", flush=True)
    print(f"\n| figure ({args.rounds} rounds) | before, least | now, least | ratio of least | ratio of medians |")
    print("|---|---:|---:|---:|---:|")
    for figure in chosen:
        before, now = (min(values[figure][t]) for t in trees)
        median = statistics.median(values[figure]["now"]) / statistics.median(values[figure]["before"])
        print(f"| {FIGURES[figure][0]} | {before:.4g} | {now:.4g} | {now / before:.3f} | {median:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
