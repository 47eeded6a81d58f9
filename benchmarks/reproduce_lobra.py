"""LobRA's experiments in simulation: lorafleet against the three baselines on the same batches.

Every row plans the workload (analytic cost model of the GPU, default planner options) and
simulates ``--steps`` sampled global batches through ``lorafleet.simulate`` for lorafleet and
each baseline (Task-Fused padding: LobRA's baseline; Task-Fused packing; Task-Sequential),
exactly as ``lorafleet whatif`` does. Printed: mean GPU-seconds per step and lorafleet's
saving against each baseline, as a markdown table, every method under LobRA's 1F1B flushed every
step (pipeline window 1); then lorafleet's plan and GPU-seconds with windows of 8 steps (pipelined
replicas that do not drain between steps, docs/pipeline.md) next to those with 1.

Experiments (LobRA, VLDB 2025, Sec. 6):

1. Llama2-7B, 16 x A100-40GB, 6 tasks (``examples/lobra-7b.yaml``, no recomputation, LobRA's
   setup), and the same with ``recompute: auto``.
2. Llama2-70B, 64 x A800-80GB, 12 tasks (``examples/lobra-70b.yaml``: 16K contexts, the
   planner decides which replicas recompute activations).
3. 70B, 4 tasks (Evol-Instruct, CommitPackFT, BillSum, PubMedQA) on 16, 32 and 64 GPUs.
4. 70B on 64 GPUs with 4, 8, 12 and 16 tasks: the 4 above; plus dolly, python-code, XSum,
   MeetingBank; all 12; all 12 plus a second tenant of dolly, Evol-Instruct, XSum and BillSum
   (same dataset statistics, its own adapter: 12 presets exist, LobRA does not list its 16).

    .venv/bin/python benchmarks/reproduce_lobra.py              # everything (~40 s on 2 cores)
    .venv/bin/python benchmarks/reproduce_lobra.py --only 70b   # experiments 2-4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lorafleet.whatif import Variation, sweep
from lorafleet.workload import Workload, load_workload, resolve_workload

REPO = Path(__file__).resolve().parents[1]
FOUR = ("evol-instruct", "commitpackft", "billsum", "pubmedqa")
EIGHT = (*FOUR, "dolly", "python-code", "xsum", "meetingbank")
SECOND_TENANTS = ("dolly", "evol-instruct", "xsum", "billsum")
BASELINES = ("task-fused-padding", "task-fused-packing", "task-sequential")
WINDOW = 8
"""The pipeline window lorafleet trains with by default (``--pipeline-window``)."""


def with_tasks(workload: Workload, names: tuple[str, ...] | None = None, twins: tuple[str, ...] = ()) -> Workload:
    """The workload keeping the tasks ``names`` (all when None), plus a second tenant ``<name>-2``
    of each of ``twins``."""
    tasks = [t for t in workload.spec.tasks if names is None or t.name in names]
    tasks += [t.model_copy(update={"name": f"{t.name}-2"}) for t in workload.spec.tasks if t.name in twins]
    return resolve_workload(workload.spec.model_copy(update={"tasks": tuple(tasks)}), workload.path)


_RUNS: dict[tuple, dict[str, dict]] = {}
"""Experiments already simulated, by (workload spec as JSON, gpus, steps, recompute, window): a workload holds
mappings, so it is not hashable itself."""


def _simulated(workload: Workload, gpus: int, steps: int, recompute: str | None, window: int) -> dict[str, dict]:
    """Rows of ``lorafleet.whatif.sweep`` by method (an experiment shared by two sweeps runs once);
    ``recompute`` overrides the workload's policy, ``window`` sets the pipeline window, through the
    sweep's own axes."""
    key = (workload.spec.model_dump_json(), gpus, steps, recompute, window)
    if key not in _RUNS:
        _RUNS[key] = _sweep(workload, gpus, steps, recompute, window)
    return _RUNS[key]


def _sweep(workload: Workload, gpus: int, steps: int, recompute: str | None, window: int) -> dict[str, dict]:
    axes = [
        Variation("gpus", (str(gpus),)),
        Variation("window", (str(window),)),
        *([Variation("recompute", (recompute,))] if recompute else []),
    ]
    return {r["method"]: r for r in sweep(workload, axes, steps=steps)}


def row(label: str, workload: Workload, gpus: int, steps: int, recompute: str | None = None, window: int = 1) -> str:
    """One markdown row: the experiment, lorafleet's plan and GPU-s, each baseline's GPU-s and the saving."""
    start = time.perf_counter()
    rows = _simulated(workload, gpus, steps, recompute, window)
    ours = rows["lorafleet"]["gpu_s_per_step"]
    cells = [
        f"{rows[b]['gpu_s_per_step']:.0f} (-{100 * (1 - ours / rows[b]['gpu_s_per_step']):.1f}%)" for b in BASELINES
    ]
    print(f"  [{label}: {time.perf_counter() - start:.0f} s]", flush=True)
    return (
        f"| {label} | {gpus} | {len(workload.tasks)} | {rows['lorafleet']['plan']} | {ours:.0f} | "
        + " | ".join(cells)
        + " |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="simulated steps per method (default 8)")
    parser.add_argument("--only", choices=("7b", "70b"), help="run one model's experiments")
    args = parser.parse_args()
    lines = [
        "| experiment | GPUs | tasks | lorafleet plan | lorafleet GPU-s/step | Task-Fused padding | Task-Fused packing "
        "| Task-Sequential |",
        "|---|---|---|---|---|---|---|---|",
    ]
    experiments = []  # (label, workload, gpus, recompute)
    if args.only in (None, "7b"):
        seven = load_workload(REPO / "examples/lobra-7b.yaml")
        experiments += [("7B, LobRA setup (no recompute)", seven, 16, None), ("7B, recompute auto", seven, 16, "auto")]
    if args.only in (None, "70b"):
        seventy = load_workload(REPO / "examples/lobra-70b.yaml")
        four = with_tasks(seventy, FOUR)
        experiments.append(("70B, 12 tasks", seventy, 64, None))
        experiments += [("70B, 4 tasks, GPU sweep", four, gpus, None) for gpus in (16, 32, 64)]
        for label, workload in (
            ("4", four),
            ("8", with_tasks(seventy, EIGHT)),
            ("12", seventy),
            ("16", with_tasks(seventy, twins=SECOND_TENANTS)),
        ):
            experiments.append((f"70B, task sweep ({label})", workload, 64, None))
    lines += [row(label, w, gpus, args.steps, recompute) for label, w, gpus, recompute in experiments]
    window_lines = [
        "| experiment | GPUs | lorafleet plan, W = 1 | GPU-s/step | plan, W = 8 | GPU-s/step | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, w, gpus, recompute in experiments:
        drained = _simulated(w, gpus, args.steps, recompute, 1)["lorafleet"]
        streamed = _simulated(w, gpus, args.steps, recompute, WINDOW)["lorafleet"]
        change = streamed["gpu_s_per_step"] / drained["gpu_s_per_step"] - 1
        window_lines.append(
            f"| {label} | {gpus} | {drained['plan']} | {drained['gpu_s_per_step']:.0f} | {streamed['plan']} | "
            f"{streamed['gpu_s_per_step']:.0f} | {100 * change:+.1f}% |"
        )
    print("\nGPU-seconds per step, mean over the simulated steps (lorafleet's saving in parentheses),")
    print("every method 1F1B flushed every step (pipeline window 1, LobRA's schedule):\n")
    print("\n".join(lines))
    print(f"\nThe same experiments with pipelined replicas streaming windows of {WINDOW} steps (docs/pipeline.md):\n")
    print("\n".join(window_lines))


if __name__ == "__main__":
    main()
