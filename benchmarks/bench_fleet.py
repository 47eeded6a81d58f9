"""lorafleet's plan against the homogeneous baselines as real torch training runs: measured and predicted.

    python benchmarks/bench_fleet.py [--steps 10] [--repeats 2] [--profile profiles/tiny-llama-cpu.json] [--keep DIR]

One workload, four ways, each trained for ``--steps`` steps by ``lorafleet train`` (torchrun, gloo,
CPU, up to 4 ranks of one thread) on ``tiny-llama`` (the project's random-weight Llama, 4 blocks,
width 64) with the project's tiny tokenizer:

- the tasks are the demo's four (``examples/demo``: chat ~50 tokens, code and document
  summaries ~100-800, module documentation up to its 1536-token context), with larger batches;
- the cluster is 4 ``cpu`` devices with the profile's 48 MiB budget each, so the long task
  needs a TP2 or PP2 replica (M = 1344 tokens on <1,1>);
- lorafleet's plan is made by ``lorafleet plan`` with the fitted profile; the baselines
  (Task-Fused padding, Task-Fused packing, Task-Sequential: one run per task, one after another)
  are the planner's, as ``lorafleet plan`` prints them, on the same profile.

Every method runs ``--repeats`` times, the methods interleaved; each method's figures are those of
its round with the least measured CPU time (a shared machine's other load only ever adds to it;
the spread of the rounds is printed). Printed per method, over the steps after the first
(one-time start-up costs):

- **measured CPU-s/step**: the ranks' process CPU time summed (``rank_cpu_s`` of the step
  reports), the analogue of GPU-seconds that a shared 2-core machine does not distort;
- **predicted**: the cost model (the profile, uncorrected) on the very micro-batches each step ran,
  summed the same way: every replica's modelled busy time times its devices (what the simulator
  reports for that step); and the predicted GPU-seconds, makespan times devices held;
- the savings of lorafleet over each baseline, measured and predicted;
- **after recalibration**: each step's modelled busy time as the dispatcher priced it (the model
  corrected by what earlier steps measured) against the busy time measured, from the third step
  on (the first corrected dispatch: step 1 is dispatched ahead, before step 0's report).

Wall time is not used: four processes on two cores wait for each other's core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorafleet.assemble import workload_cluster, workload_cost_model  # noqa: E402
from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from lorafleet.planner import workload_baselines  # noqa: E402
from lorafleet.plans import DeploymentPlan  # noqa: E402
from lorafleet.specs.dispatch import DispatchPolicy  # noqa: E402
from lorafleet.workload import load_workload  # noqa: E402

DEMO = REPO / "examples" / "demo"
TASKS = (  # name, batch size, context length (the demo's data; larger batches)
    ("docsum", 12, 384),
    ("codegen", 8, 768),
    ("chat", 24, 256),
    ("moddoc", 1, 1536),
)


def write_workload(root: Path, tokenizer: Path, tasks=TASKS) -> Path:
    spec = {
        "model": "tiny-llama",
        "tokenizer": str(tokenizer),
        "seed": 0,
        "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 4},
        "defaults": {"lora": {"rank": 8, "alpha": 16}, "optimizer": {"lr": 1e-3}},
        "tasks": [
            {"name": n, "data": {"path": str(DEMO / f"{n}.jsonl")}, "batch_size": b, "context_length": c}
            for n, b, c in tasks
        ],
    }
    path = root / f"workload-{'-'.join(t[0] for t in tasks)}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def train(workload: Path, plan: Path, out: Path, steps: int) -> list[dict]:
    """One ``lorafleet train`` run; its step records."""
    cmd = [
        sys.executable,
        "-m",
        "lorafleet",
        "train",
        str(workload),
        "--plan",
        str(plan),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--device",
        "cpu",
        "--checkpoint-every",
        "100000",
        "--no-progress",
    ]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    print(f"    {out.name}: {steps} steps in {time.perf_counter() - started:.0f} s wall", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_figures(records: list[dict], plan: DeploymentPlan) -> dict[str, np.ndarray]:
    """Per step: measured CPU-s, modelled busy GPU-s, modelled makespan x GPUs, and the recalibrated
    prediction of the busy time against the measured one (each summed over replicas times devices)."""
    gpus = np.array([r.config.n_gpus for r in plan.replicas])
    return {
        "cpu_s": np.array([sum(r["rank_cpu_s"]) for r in records]),
        "model_busy": np.array([float(np.dot(r["model_busy_s"], gpus)) for r in records]),
        "model_gpu_s": np.array([max(r["model_busy_s"]) * plan.used_gpus for r in records]),
        "priced_busy": np.array([float(np.dot(r["predicted_busy_s"], gpus)) for r in records]),
        "busy": np.array([float(np.dot(r["replica_busy_s"], gpus)) for r in records]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=10, help="training steps per run (default 10; the first is warm-up)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds of every method, interleaved; the least measured CPU time of each method counts (default 2)",
    )
    parser.add_argument("--profile", default=str(REPO / "profiles" / "tiny-llama-cpu.json"))
    parser.add_argument("--keep", help="keep the runs under this directory")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-fleet-"))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    workload_path = write_workload(root, tokenizer)
    workload = load_workload(workload_path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster, args.profile)

    ours = root / "lorafleet.json"
    subprocess.run(
        [sys.executable, "-m", "lorafleet", "plan", str(workload_path), "--profile", args.profile, "--json", str(ours)],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    runs: dict[str, list[tuple[Path, Path]]] = {"lorafleet": [(workload_path, ours)]}
    flushed = DispatchPolicy(pipeline_window=1)  # the baselines' window these figures were measured with
    for schedule in workload_baselines(workload, cluster, cost_model, flushed):
        runs[schedule.name] = []
        for phase in schedule.phases:
            tasks = tuple(TASKS[k] for k in phase.tasks)
            path = workload_path if len(tasks) == len(TASKS) else write_workload(root, tokenizer, tasks)
            plan = replace(phase.plan, tasks=tuple(t[0] for t in tasks))
            target = root / f"{schedule.name}-{'-'.join(t[0] for t in tasks)}.json"
            plan.save(target)
            runs[schedule.name].append((path, target))

    print(
        f"workload: {', '.join(f'{n} (batch {b}, context {c})' for n, b, c in TASKS)} on 4 x cpu; "
        f"cost model {cost_model.source}"
    )
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for round_ in range(args.repeats):  # methods interleaved: a slow spell of the machine hits all alike
        for name, parts in runs.items():
            print(f"  {name} (round {round_ + 1}):", flush=True)
            total: dict[str, float] = {}
            for workload_file, plan_file in parts:
                plan = DeploymentPlan.load(plan_file)
                out = root / "runs" / f"{plan_file.stem}-{round_}"
                shutil.rmtree(out, ignore_errors=True)
                per_step = step_figures(train(workload_file, plan_file, out, args.steps), plan)
                print(f"      {plan.describe()} ({plan.policy.describe()})")
                for key, values in per_step.items():
                    later = values[1:] if key in ("cpu_s", "model_busy", "model_gpu_s") else values[2:]
                    total[key] = total.get(key, 0.0) + float(later.sum())
                total["steps_cpu"] = total.get("steps_cpu", 0.0) + len(per_step["cpu_s"]) - 1
            samples[name].append(total)
    # per method, the round with the least measured CPU time (other load only ever adds to it);
    # every figure of that round, as means per step
    figures = {}
    for name, rounds in samples.items():
        best = min(rounds, key=lambda f: f["cpu_s"])
        n_cpu, n_cal = args.steps - 1, args.steps - 2
        figures[name] = {
            k: v / (n_cpu if k in ("cpu_s", "model_busy", "model_gpu_s") else n_cal)
            for k, v in best.items()
            if k != "steps_cpu"
        }
        figures[name]["spread"] = max(f["cpu_s"] for f in rounds) / best["cpu_s"] - 1

    base = figures["lorafleet"]
    print(
        f"\n{'method':20s} {'measured CPU-s':>15s} {'predicted':>10s} {'pred. GPU-s':>12s} "
        f"{'saved, measured':>16s} {'saved, predicted':>17s} {'recalibrated/measured':>22s} {'round spread':>13s}"
    )
    for name, f in figures.items():
        saved = "" if name == "lorafleet" else f"{1 - base['cpu_s'] / f['cpu_s']:16.1%}"
        predicted = "" if name == "lorafleet" else f"{1 - base['model_busy'] / f['model_busy']:17.1%}"
        print(
            f"{name:20s} {f['cpu_s']:15.3f} {f['model_busy']:10.3f} {f['model_gpu_s']:12.3f} {saved:>16s} "
            f"{predicted:>17s} {f['priced_busy'] / f['busy']:22.3f} {f['spread']:13.1%}"
        )
    print(
        f"\n(steps 2..{args.steps} measured; recalibration compared from step 3; the least of {args.repeats} "
        f"interleaved rounds per method; round spread: the other rounds' excess; runs under {root})"
    )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
