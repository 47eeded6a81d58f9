"""A restart amid a move, end to end on 4 ranks: each run checked bitwise against the uninterrupted one (#38).

The fleet of ``tests/train/test_task_queue.py``'s moves: ``docsum`` and ``chat`` on two ``<1,1>`` replicas of a
node of 4 GPUs (ranks 0 and 3, the others idle), by the GPU-seconds objective with free migration and
``--no-recalibrate``:

- ``codegen`` joins at step 3 on the kept deployment, and the re-plan beside the steps answers at step 4 with a
  move: one ``<1,1>`` replica (a ``replan`` row, ``moved``);
- ``moddoc``'s 1,536-token documents fit no ``<1,1>``, so its add at step 5 re-plans at the boundary and builds
  new stages in place (a ``change`` row, ``moved``, stages rebuilt).

Each round kills one process once at a phase of one of the two moves (``runtime.processes.FAULT_ENV``): rank 0
at ``decided`` (the move recorded in ``.apply.json``, not applied), ``applied`` (the fleet moved in place, its
checkpoint not yet committed) or ``settling`` (a checkpoint after the move committed, its files not yet written),
or rank 1 amid the change's collective (``slots``); torchrun restarts the workers (``--max-restarts 1``). A round
passes when the run ends with exit 0, every step is counted once, ``changes.jsonl`` has the reference's rows (step,
kind, outcome, plan; a move the restart only settled says ``settled``), nothing is left in flight and every
adapter equals the uninterrupted run's bitwise.

    python benchmarks/soak_moves.py            # every cell once
    python benchmarks/soak_moves.py --cells applied@4:0 settling@5:0
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_restarts import LAUNCHER, steps_logged

from tests.helpers.queue_fleet import add_request, on_four_gpus

TASKS = ("docsum", "chat", "codegen", "moddoc")
CELLS = ("decided@4:0", "applied@4:0", "settling@4:0", "decided@5:0", "applied@5:0", "settling@5:0", "slots@5:1")
"""phase@step:rank: step 4 is the re-plan's move, step 5 moddoc's (``slots``: rank 1 amid its collective)."""
STEPS = 8


def queue(out: Path) -> None:
    (out / "queue").mkdir(parents=True)
    add_request(out / "queue", "codegen", batch=2, context=256, at_step=3)
    add_request(out / "queue", "moddoc", batch=1, context=1536, at_step=5)


def run(workload: Path, profile: Path, out: Path, env: dict[str, str], *extra: str, timeout: float) -> int:
    argv = [*LAUNCHER, "train", str(workload), "--plan", str(workload.with_suffix(".plan.json")), "--out", str(out),
            "--device", "cpu", "--no-recalibrate", "--steps", str(STEPS), "--no-progress", "--profile", str(profile),
            "--checkpoint-every", "100", "--replan-objective", "gpu-s", "--migration-s", "0", *extra]  # fmt: skip
    with (out.parent / f"{out.name}.log").open("w") as log:
        return subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out.parent,
                              timeout=timeout).returncode  # fmt: skip


def outcome(out: Path) -> tuple[list[int], list[tuple], dict[str, bytes], bool]:
    """(steps logged, change rows as (step, kind, outcome, plan), adapters, a change left in flight)."""
    steps = steps_logged(out)
    rows = [json.loads(line) for line in (out / "changes.jsonl").read_text().splitlines() if line.strip()]
    changes = [(r["step"], r["kind"], r["outcome"], r["plan"]) for r in rows]
    adapters = {t: (out / "adapters" / t / "adapter_model.safetensors").read_bytes() for t in TASKS}
    in_flight = any((out / "queue" / name).exists() for name in (".apply.json", ".replan.json"))
    return steps, changes, adapters, in_flight


def same_changes(rows: list[tuple], reference: list[tuple]) -> bool:
    """The reference's rows (step, kind, outcome, plan), but that a move the restart only settled (its checkpoint was
    taken after it: ``train.inflight``) says ``settled``."""
    return len(rows) == len(reference) and all(
        (s, k, p) == (rs, rk, rp) and o in (ro, "settled") for (s, k, o, p), (rs, rk, ro, rp) in zip(rows, reference)
    )


def one_round(cell: str, workload: Path, profile: Path, tmp: Path, reference, timeout: float) -> str:
    """'' when the round passed, else why not."""
    out = tmp / f"round-{cell.replace('@', '-').replace(':', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    queue(out)
    once = tmp / f"{out.name}.once"
    once.unlink(missing_ok=True)
    env = {**os.environ, "LORAFLEET_FAULT": cell, "LORAFLEET_FAULT_ONCE": str(once)}
    try:
        code = run(workload, profile, out, env, "--max-restarts", "1", timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"hung: not finished within {timeout:.0f} s"
    if not once.exists():
        return "the fault point was never reached"
    if code != 0:
        return f"exit {code} (log in {out}.log)"
    steps, changes, adapters, in_flight = outcome(out)
    if steps != list(range(STEPS)):
        return f"metrics hold steps {steps}"
    if not same_changes(changes, reference[1]):
        return f"changes.jsonl has {changes}, the uninterrupted run {reference[1]}"
    if in_flight:
        return "a change is left in flight"
    differ = [t for t in TASKS if adapters[t] != reference[2][t]]
    return f"adapters of {differ} differ from the uninterrupted run's" if differ else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="*", default=list(CELLS), help="phase@step:rank of each round")
    parser.add_argument("--round-timeout", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--keep", help="keep the runs under this directory")
    args = parser.parse_args()
    from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer

    tmp = Path(args.keep or tempfile.mkdtemp(prefix="soak-moves-"))
    tmp.mkdir(parents=True, exist_ok=True)
    workload, profile = on_four_gpus(tmp, build_tiny_tokenizer(tmp / "tokenizer"), slots=(0, 3))
    start = time.monotonic()
    reference_out = tmp / "reference"
    shutil.rmtree(reference_out, ignore_errors=True)
    queue(reference_out)
    code = run(workload, profile, reference_out, dict(os.environ), timeout=args.round_timeout)
    if code != 0:
        print(f"the uninterrupted run failed: exit {code} (log in {reference_out}.log)")
        return 1
    reference = outcome(reference_out)
    print(f"reference run: {STEPS} steps, changes {reference[1]}, in {time.monotonic() - start:.0f} s", flush=True)
    moved = [c for c in reference[1] if c[2] == "moved"]
    if [(c[0], c[1]) for c in moved] != [(4, "replan"), (5, "change")]:
        print(f"the uninterrupted run did not move at the re-plan of step 4 and moddoc's add at 5: {reference[1]}")
        return 1
    failed = 0
    for k, cell in enumerate(args.cells, 1):
        start = time.monotonic()
        why = one_round(cell, workload, profile, tmp, reference, args.round_timeout)
        failed += bool(why)
        verdict = "ok" if not why else f"FAILED: {why}"
        print(f"round {k} ({cell}, restart): {verdict} ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"{len(args.cells) - failed} of {len(args.cells)} rounds ended as the uninterrupted run", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
