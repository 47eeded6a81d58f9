"""What a queued change costs a running ``lorafleet train``: applied in the running workers (#28) against a
relaunch of the workers (how every change was applied before; ``LORAFLEET_RELAUNCH_CHANGES=1`` forces it).

Measured, for each change: the time from the request's step boundary (the end of the step before it) to the
start of the next step, on the torch executor (CPU, gloo, one thread a rank), from outside the run: each
step's log line is stamped as it arrives on the run's stdout (``--no-progress``: one flushed line a step),
and a step starts its makespan before its line, so

    boundary cost = (line(S) - makespan(S)) - line(S - 1)

for the change at step S (the same figure for a step without a change is the loop's own gap between two
steps, printed beside it). Two runs, each once in the running workers and once relaunching, interleaved in
rounds (``--rounds``), the best round of each kept:

- **kept**: tiny-llama on 1 rank, docsum and chat (batches of 12 and 24, as ``bench_fleet.py``'s); ``codegen``
  added at step 3, ``chat`` finished at step 6, ``docsum``'s share updated at step 9: the deployment is kept
  at every change;
- **move**: tiny-llama on 4 ranks of 48 MiB (``profiles/tiny-llama-cpu.json``), docsum and chat on two
  ``<1,1>`` replicas (ranks 0 and 3); ``moddoc`` (1,536-token documents, which only a TP2 or PP2 replica
  holds) added at step 3: the re-plan moves to ``<1,1> x 2 + <2,1>``, 2 replicas to 3 on 4 ranks.

Targets (issue #28): with the deployment kept a change costs at most one step of the run; an in-process
rebuild at most half a relaunch. The script prints each figure, the run's median step, and the ratios.

A join or a departure the kept deployment serves is applied at once and its re-plan runs beside the next
step (``train.background``, ``--replan-after 1``): its answer is applied at the boundary after it. So each row
also says what the change costs after its boundary: the next boundary's gap (its re-plan's answer, waited for
when the re-plan is not done) and the step the re-plan ran beside, against the median of the two after it (the
same tasks: a join makes every step after it longer).

It also measures the two figures of the migration price (``planner.incremental.MigrationModel``): the rate
a rank builds its stage from a safetensors checkpoint (a random 12-layer, width-768 Llama, 88M parameters in
bf16, built per stage in fp32 as ``lorafleet train`` builds it, every value touched: bytes of the stage over
seconds), and the fixed part of a move (the move's in-process change less its stage builds, from its log).

    python benchmarks/bench_queue.py [--rounds 2] [--keep DIR]

``--replan WORKLOAD`` measures instead what a change's incremental re-plan costs at a workload's scale (a
service's: ``examples/service-64.yaml``): the workload planned without its last task, then the re-plan with it
added (a tenant joins; ``planner.incremental.replan_incremental``, as ``lorafleet train`` runs it), in CPU
seconds (this process and its CBC solves: ``lorafleet.work.cpu_seconds``) and wall seconds, best of
``--rounds``, and as a share of the new plan's expected step time; and the boundary's own work when the
running deployment serves the new tasks (``planner.incremental.kept_plan`` by a cost model built afresh, as
``train.changes`` does): then the fleet waits for that, and the re-plan runs beside the next step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo"
PROFILE = REPO / "profiles" / "tiny-llama-cpu.json"
RELAUNCH = {"LORAFLEET_RELAUNCH_CHANGES": "1"}


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int
    tasks: tuple[tuple[str, int, int], ...]
    """The workload's tasks: name, batch size, context length."""
    requests: dict[str, object]
    """Request file name -> its content."""
    changes: dict[int, str]
    """Step -> what changes there (the rows printed)."""
    steps: int


KEPT = Scenario(
    "kept",
    1,
    (("docsum", 12, 384), ("chat", 24, 256)),
    {
        "add-codegen.json": {"name": "codegen", "data": {"path": str(DEMO / "codegen.jsonl")}, "batch_size": 4,
                             "context_length": 768, "at_step": 3},
        "finish-chat.json": {"action": "finish", "name": "chat", "at_step": 6},
        "share-docsum.json": {"action": "update", "name": "docsum", "share": 0.5, "at_step": 9},
    },
    {3: "add (kept)", 6: "finish (kept)", 9: "update (kept)"},
    12,
)  # fmt: skip
MOVE = Scenario(
    "move",
    4,
    (("docsum", 12, 384), ("chat", 24, 256)),
    {
        "add-moddoc.json": {"name": "moddoc", "data": {"path": str(DEMO / "moddoc.jsonl")}, "batch_size": 1,
                            "context_length": 1536, "at_step": 3},
    },
    {3: "add: 2 -> 3 replicas on 4 ranks"},
    6,
)  # fmt: skip


def write_workload(root: Path, tokenizer: Path, scenario: Scenario) -> Path:
    spec = {
        "model": "tiny-llama",
        "tokenizer": str(tokenizer),
        "seed": 0,
        "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": scenario.gpus},
        "defaults": {"lora": {"rank": 8, "alpha": 16}, "optimizer": {"lr": 1e-3}},
        "tasks": [
            {"name": n, "data": {"path": str(DEMO / f"{n}.jsonl")}, "batch_size": b, "context_length": c}
            for n, b, c in scenario.tasks
        ],
    }
    path = root / f"{scenario.name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def write_plan(workload_path: Path, scenario: Scenario) -> Path:
    """The planner's plan (kept), or two ``<1,1>`` replicas on ranks 0 and 3 of 4 (move)."""
    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.planner import PlannerOptions, plan_deployment
    from lorafleet.planner.incremental import kept_plan
    from lorafleet.workload import load_workload

    workload = load_workload(workload_path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster, PROFILE)
    plan = plan_deployment(workload, cluster, cost_model, PlannerOptions(robust_samples=0, baselines=False)).plan
    if scenario is MOVE:
        one = next(r for r in plan.replicas if r.config.n_gpus == 1)
        two = (replace(one, replica_id=0, gpus=(0,)), replace(one, replica_id=1, gpus=(3,)))
        plan = kept_plan(replace(plan, replicas=two), workload, cost_model)
    path = workload_path.with_suffix(".plan.json")
    plan.save(path)
    return path


def load_rate(root: Path) -> tuple[float, float]:
    """(bytes, seconds) of one rank building a ``<1,1>`` stage per stage from the saved random Llama."""
    sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]  # bench_stage_loading; the tests' plan helper
    import torch
    from bench_stage_loading import save_model

    from lorafleet.data.model_source import ModelSource, SourceKind
    from lorafleet.executor.torch.base_model import load_base
    from lorafleet.executor.torch.replica import build_stage
    from lorafleet.executor.torch.routing import LoraBackend
    from lorafleet.runtime.layout import FleetLayout, ModelDims
    from lorafleet.specs.lora import LoraSpec
    from tests.helpers.fleet_harness import plan_of

    directory = root / "llama-88m"
    directory.mkdir(exist_ok=True)
    save_model(directory, 12, 768, 8192, "bf16")
    source = ModelSource(kind=SourceKind.HF_DIR, name=str(directory), path=str(directory))
    started = time.perf_counter()
    model, weights = load_base(source, torch.float32)
    role = FleetLayout.of(plan_of((1, 1)), ModelDims.of(model.config), 1).role(0)
    stage = build_stage(model, [LoraSpec(rank=8)], role, None, seeds=[0], device=torch.device("cpu"),
                        backend=LoraBackend.TORCH, weights=weights)  # fmt: skip
    held = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()])
    sum(float(t.detach().float().sum()) for t in stage.parameters())  # touched, as the first forward would
    return held, time.perf_counter() - started


def run(workload: Path, plan: Path, out: Path, scenario: Scenario, relaunch: bool):
    """One ``lorafleet train`` run with the scenario's requests queued: step -> seconds from the previous step's
    end to its start, the step records, and the seconds the fleet's in-process changes took less their stage
    builds (from their log lines)."""
    (out / "queue").mkdir(parents=True)
    for name, request in scenario.requests.items():
        (out / "queue" / name).write_text(json.dumps(request))
    cmd = [sys.executable, "-m", "lorafleet", "train", str(workload), "--plan", str(plan), "--out", str(out),
           "--steps", str(scenario.steps), "--device", "cpu", "--profile", str(PROFILE), "--checkpoint-every",
           "100000", "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(RELAUNCH if relaunch else {})}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out, env=env)
    arrived: dict[int, float] = {}
    fixed = []
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("step ") and "/" in line.split()[1]:
            arrived[int(line.split()[1].split("/")[0]) - 1] = time.perf_counter()
        elif "applied in the running fleet in " in line:
            seconds = float(line.split("applied in the running fleet in ")[1].split()[0])
            stage = line.split("stage ")[1].split()[0] if "; stage " in line else "0"
            fixed.append(seconds - float(stage))
    _, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    gaps = {s: arrived[s] - records[s]["makespan_s"] - arrived[s - 1] for s in range(1, scenario.steps)}
    return gaps, records, fixed


def replan_at_scale(path: Path, rounds: int) -> None:
    """The ``--replan`` measurement (module doc)."""
    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.planner import PlannerOptions, ReplanOptions, plan_deployment, replan_incremental
    from lorafleet.planner.incremental import kept_plan
    from lorafleet.work import cpu_seconds as cpu
    from lorafleet.workload import load_workload

    workload = load_workload(path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster, None)
    before = replace(workload, tasks=workload.tasks[:-1])
    running = plan_deployment(before, cluster, cost_model, PlannerOptions()).plan
    timings, kept = [], []
    for _ in range(rounds):
        cpu0, wall0 = cpu(), time.perf_counter()
        replan = replan_incremental(running, workload, cluster, cost_model, PlannerOptions(), ReplanOptions(), 10**6)
        timings.append((cpu() - cpu0, time.perf_counter() - wall0))
        cpu0, wall0 = cpu(), time.perf_counter()
        keep = kept_plan(running, workload, workload_cost_model(workload, cluster, None))  # a cold cost model
        kept.append((cpu() - cpu0, time.perf_counter() - wall0))
    spent, wall = min(timings)
    step = replan.plan.expected_makespan_s
    print(
        f"{path.name}: {len(before.tasks)} tasks on {running.used_gpus} GPUs, {workload.tasks[-1].spec.name} joins: "
        f"the re-plan takes {spent:.2f} CPU s ({wall:.2f} s wall; best of {rounds}), {spent / step:.2f} of the new "
        f"plan's expected step ({step:.3g} s); {replan.describe()[:60]}..."
    )
    if keep is not None:
        spent, wall = min(kept)
        print(
            f"  the boundary's own work when the running deployment serves the new tasks (the kept plan, the re-plan "
            f"beside the next step): {spent:.3f} CPU s ({wall:.3f} s wall), {spent / keep.expected_makespan_s:.4f} of "
            f"the kept plan's expected step ({keep.expected_makespan_s:.3g} s)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every run, interleaved (default 2)")
    parser.add_argument("--keep", help="keep the runs in this directory")
    parser.add_argument("--replan", type=Path, help="measure the boundary's re-plan on this workload instead")
    args = parser.parse_args()
    if args.replan is not None:
        replan_at_scale(args.replan, args.rounds)
        return 0
    from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer

    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-queue-"))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = root / "tokenizer"
    if not tokenizer.is_dir():
        build_tiny_tokenizer(tokenizer)
    inputs = {}
    for scenario in (KEPT, MOVE):
        workload = write_workload(root, tokenizer, scenario)
        inputs[scenario.name] = (workload, write_plan(workload, scenario))
    best: dict[tuple[str, bool], tuple[dict[int, float], dict]] = {}
    fixed: list[float] = []
    loads = []
    for k in range(args.rounds):
        loads.append(load_rate(root))
        for scenario in (KEPT, MOVE):
            for relaunch in (False, True):
                how = "relaunch" if relaunch else "in-process"
                out = root / f"{scenario.name}-{how}-{k}"
                started = time.perf_counter()
                gaps, records, moved = run(*inputs[scenario.name], out, scenario, relaunch)
                if scenario is MOVE and not relaunch:
                    fixed += moved
                print(f"  {out.name}: {time.perf_counter() - started:.0f} s wall", flush=True)
                key = (scenario.name, relaunch)
                total = sum(gaps[s] for s in scenario.changes)
                if key not in best or total < sum(best[key][0][s] for s in scenario.changes):
                    best[key] = (gaps, records)
    print()
    print("| change | run's step (median s) | loop gap (median s) | in the running workers (s) | next boundary (s) "
          "| its step / the next two | relaunch (s) | in-process / step | in-process / relaunch |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for scenario in (KEPT, MOVE):
        gaps, records = best[(scenario.name, False)]
        relaunched, _ = best[(scenario.name, True)]
        near = {t for s in scenario.changes for t in (s, s + 1, s + 2)}
        quiet = [s for s in range(2, scenario.steps) if s not in near]
        step = statistics.median(records[s]["makespan_s"] for s in range(1, scenario.steps))
        loop = statistics.median(gaps[s] for s in quiet) if quiet else float("nan")
        for s, what in scenario.changes.items():
            after = f"{gaps[s + 1]:.3f}" if s + 1 in gaps else "-"
            beside = records[s]["makespan_s"] / statistics.median(records[t]["makespan_s"] for t in (s + 1, s + 2))
            print(
                f"| {what} (step {s}) | {step:.3f} | {loop:.3f} | {gaps[s]:.3f} | {after} "
                f"| {beside:.2f} | {relaunched[s]:.2f} "
                f"| {gaps[s] / step:.2f} | {gaps[s] / relaunched[s]:.3f} |"
            )
    held, seconds = min(loads, key=lambda load: load[1])
    print(
        f"\nmigration price: a stage built per stage at {held / seconds / 1e6:.0f} MB/s ({held / 2**20:.0f} MiB in "
        f"{seconds:.2f} s, the best of {len(loads)}); a move's fixed part {min(fixed):.2f} s (the least of "
        f"{len(fixed)}: its change less its stage builds)"
    )
    print(f"runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
