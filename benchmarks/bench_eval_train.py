"""What evaluation costs in a real training run against what the cost model predicts (issue #39, T2 on the CPU demo).

The demo (``examples/demo/workload.yaml``: SmolLM2-135M-Instruct, four tasks, CPU, one gloo rank, the plan for
1 x cpu, as ``make demo-train``) trains ``--steps`` steps with every task evaluated every ``--every`` of its steps
on a ``--split`` of its rows (``--set defaults.eval...``). From the run's ``metrics.jsonl``:

    measured overhead  = Σ eval_s / Σ makespan_s                       (the evaluations' wall time over the steps')
    predicted overhead = Σ eval_predicted_s / Σ estimated_makespan_s   (the cost model's, recalibrated alike)

``eval_predicted_s`` is the pass's forward-only time by ``CostModel.forward_time`` at the replicas' recalibrated
speeds (``eval_replay.forward_seconds``), the estimate of the step its row follows is the dispatcher's. T2 asks the
two to agree within 5 points. The script prints both, their difference, each evaluation, and the command.

``--profile PATH`` plans and trains by a measured profile (``profiles/smollm2-135m-cpu.json``), whose forward
coefficients price the passes, where the default is the analytic model of the ``cpu`` preset, which prices them
as assumed shares of the training pass (``CostModel.forward_time``). Before the run the script prints, for each
model, the forward share of a training pass over one pass's micro-batches (12 held-out rows a task, packed on the
demo's plan): ``Σ_r T_F,r / Σ_r (T_r - overhead_r)``, and that pass's forward time over a step's time, the mean
over 8 sampled steps. A run's first prediction is its steps' recalibrated speed times the forward time, so the
second figure's ratio between the models is how far apart their first predictions are.

    python benchmarks/bench_eval_train.py [--steps 16] [--every 4] [--split 0.02] [--profile PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "examples" / "demo" / "workload.yaml"
LORAFLEET = [sys.executable, "-m", "lorafleet"]


def forward_shares(profile: str | None) -> None:
    """Print each cost model's forward share of a training pass over one evaluation's micro-batches (module doc)."""
    from lorafleet.assemble import workload_cost_model
    from lorafleet.dispatch import dispatch_step
    from lorafleet.eval_replay import dispatch_evaluation, held_out_lengths
    from lorafleet.planner import plan_deployment
    from lorafleet.sampling import TaskDraw, global_batch, sample_global_batch
    from lorafleet.specs.cluster import ClusterSpec
    from lorafleet.workload import load_workload

    workload = load_workload(WORKLOAD, ["defaults.eval.split=0.05"])
    cluster = ClusterSpec(gpu="cpu", nodes=1, gpus_per_node=1)
    analytic = workload_cost_model(workload, cluster)
    plan = plan_deployment(workload, cluster, analytic).plan
    draws = [(k, 0, TaskDraw(held_out_lengths(t, workload.spec.seed), 0, 0)) for k, t in enumerate(workload.tasks)]
    work = dispatch_evaluation(global_batch(0, draws), plan, analytic).work
    models = {"analytic:cpu (assumed shares)": analytic}
    if profile is not None:
        models[f"{profile} (measured forward)"] = workload_cost_model(workload, cluster, profile)
    steps = [dispatch_step(sample_global_batch(workload, s), plan, analytic).work for s in range(8)]
    for name, cm in models.items():
        forward = backward = 0.0
        for replica, w in zip(plan.replicas, work):
            shapes = [mb.shape for mb in w.microbatches]
            forward += cm.forward_time(replica.config, shapes)
            backward += cm.replica_time(replica.config, shapes) - cm.step_overhead(replica.config)
        step_s = [max(cm.replica_time(r.config, [mb.shape for mb in w.microbatches]) for r, w in zip(plan.replicas, st))
                  for st in steps]  # fmt: skip
        print(f"  {name}: a pass's forward share of a training pass over its micro-batches {forward / backward:.3f}; "
              f"the pass over a sampled step {forward / (sum(step_s) / len(step_s)):.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4, help="evaluate every this many of a task's steps")
    parser.add_argument("--split", type=float, default=0.02, help="the held-out share (T2's simulated setting's 2%%)")
    parser.add_argument("--profile", help="plan and train by this profile (default: the analytic model of cpu)")
    args = parser.parse_args()
    start = time.perf_counter()
    forward_shares(args.profile)
    out = Path(tempfile.mkdtemp(prefix="bench-eval-train-"))
    sets = ["--set", f"defaults.eval.split={args.split}", "--set", f"defaults.eval.every_steps={args.every}"]
    sets += ["--profile", str(Path(args.profile).absolute())] if args.profile else []
    plan = out / "plan.json"
    # cwd=out: `python -m` puts the working directory first on the path, which would shadow PYTHONPATH's tree
    subprocess.run([*LORAFLEET, "plan", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu", "--json", str(plan), *sets],
                   check=True, capture_output=True, cwd=out)  # fmt: skip
    train = ["train", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu", "--plan", str(plan), "--steps", str(args.steps),
             "--out", str(out / "run"), "--no-progress", *sets]  # fmt: skip
    said = subprocess.run([*LORAFLEET, *train], check=True, capture_output=True, text=True, cwd=out).stdout
    print(*(f"  {line.split('] ', 1)[-1]}" for line in said.splitlines() if "probed an evaluation" in line), sep="\n")
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "eval_s" in r]
    for r in evaluated:
        print(f"  after step {r['step'] + 1}: {', '.join(sorted(r['eval_loss']))} evaluated in {r['eval_s']:.2f} s "
              f"(predicted {r['eval_predicted_s']:.2f} s); the step {r['makespan_s']:.2f} s "
              f"(predicted {r['estimated_makespan_s']:.2f} s)")  # fmt: skip
    measured = sum(r["eval_s"] for r in evaluated) / sum(r["makespan_s"] for r in rows)
    predicted = sum(r["eval_predicted_s"] for r in evaluated) / sum(r["estimated_makespan_s"] for r in rows)
    gap = 100 * abs(measured - predicted)
    verdict = "met" if gap <= 5 else f"MISSED by {gap - 5:.1f} points"
    print(f"T2 (CPU demo): evaluation overhead measured {measured:.1%}, predicted {predicted:.1%}: "
          f"{gap:.1f} points apart (target within 5: {verdict})")  # fmt: skip
    print(f"    $ lorafleet {' '.join(train)}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
