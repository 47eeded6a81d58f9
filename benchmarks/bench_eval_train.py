"""What evaluation costs in a real training run against what the cost model predicts (issue #39, T2 on the CPU demo).

The demo (``examples/demo/workload.yaml``: SmolLM2-135M-Instruct, four tasks, CPU, one gloo rank, the plan for
1 x cpu, as ``make demo-train``) trains ``--steps`` steps with every task evaluated every ``--every`` of its steps
on a ``--split`` of its rows (``--set defaults.eval...``). From the run's ``metrics.jsonl``:

    measured overhead  = Σ eval_s / Σ makespan_s                       (the evaluations' wall time over the steps')
    predicted overhead = Σ eval_predicted_s / Σ estimated_makespan_s   (the cost model's, recalibrated alike)

``eval_predicted_s`` is the pass's forward-only time by ``CostModel.forward_time`` at the replicas' recalibrated
speeds (``eval_replay.forward_seconds``), the estimate of the step its row follows is the dispatcher's. T2 asks the
two to agree within 5 points. The script prints both, their difference, each evaluation, and the command.

    python benchmarks/bench_eval_train.py [--steps 4] [--every 2] [--split 0.05]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--every", type=int, default=2, help="evaluate every this many of a task's steps")
    parser.add_argument("--split", type=float, default=0.05)
    args = parser.parse_args()
    start = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix="bench-eval-train-"))
    sets = ["--set", f"defaults.eval.split={args.split}", "--set", f"defaults.eval.every_steps={args.every}"]
    plan = out / "plan.json"
    subprocess.run([*LORAFLEET, "plan", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu", "--json", str(plan), *sets],
                   check=True, capture_output=True)  # fmt: skip
    train = ["train", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu", "--plan", str(plan), "--steps", str(args.steps),
             "--out", str(out / "run"), "--no-progress", *sets]  # fmt: skip
    subprocess.run([*LORAFLEET, *train], check=True, capture_output=True)
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
