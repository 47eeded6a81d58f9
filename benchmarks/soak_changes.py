"""Soak the fleet changes' fault matrix: a process killed at each phase of a change, each run checked bitwise.

Each round trains the tiny-llama workload of ``soak_restarts.py`` (docsum and chat, 2 gloo ranks, CPU,
``--no-recalibrate``) for ``--steps`` steps with two queued changes: ``codegen`` added at step 4 and ``chat``
finished at step 8 (``--checkpoint-every 3``). One process is killed once, at a seeded point of one change
(``runtime.processes.FAULT_ENV``: the process kills itself with SIGKILL there, once):

- rank 0 at a phase of ``train.changes``: ``accepted`` (the requests due, nothing recorded), ``begun``
  (``.apply.json`` with the fleet before), ``decided`` (and after), ``exported`` (a leaving task's adapter
  written), ``applied`` (the fleet changed in place), ``checkpointed`` (a join's checkpoint started),
  ``settling`` (a checkpoint after the change committed, the change's files about to be written);
- rank 1 amid the change's collective (``slots``: ``executor.torch.change``);

then the run goes on by ``--max-restarts 1`` (torchrun restarts the workers) or, without restarts, by
``--resume``; with two busy-looping processes on the machine's cores in every other round. A round passes when
the run ends with exit 0, its metrics count every step once, the ledger took each request once, ``changes.jsonl``
has one row per change, nothing is left in flight, and every adapter equals the uninterrupted run's bitwise. The
script prints a line per round and the tally (exit code 1 unless every round passed); ``--minutes`` bounds it.

    python benchmarks/soak_changes.py --minutes 60
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_restarts import DEMO, soak_setup, steps_logged, train_argv

TASKS = ("docsum", "chat", "codegen")
RANK0_PHASES = ("accepted", "begun", "decided", "exported", "applied", "checkpointed", "settling")
CHANGES = {4: "add codegen", 8: "finish chat"}


@dataclass(frozen=True)
class Fault:
    phase: str
    step: int
    rank: int
    resume: bool
    hog: bool

    @property
    def spec(self) -> str:
        return f"{self.phase}@{self.step}:{self.rank}"

    def describe(self) -> str:
        how = "--resume" if self.resume else "restart"
        return f"rank {self.rank} at {self.phase} of step {self.step} ({CHANGES[self.step]}), {how}" + (
            ", CPU hog" if self.hog else ""
        )


def matrix(seed: int) -> list[Fault]:
    """Every (phase, change, rank) of the module doc, each by a restart and by a resume, in a seeded order, the CPU
    hog on every other one (``exported`` only where a task leaves)."""
    only = {"exported": 8, "checkpointed": 4}  # a leaving task's export; a join's checkpoint
    cells = [(p, s, 0) for p, s in itertools.product(RANK0_PHASES, CHANGES) if only.get(p, s) == s]
    cells += [("slots", s, 1) for s in CHANGES]
    faults = [Fault(p, s, r, resume, False) for (p, s, r), resume in itertools.product(cells, (False, True))]
    random.Random(seed).shuffle(faults)
    return [Fault(f.phase, f.step, f.rank, f.resume, k % 2 == 1) for k, f in enumerate(faults)]


def queue(out: Path) -> None:
    (out / "queue").mkdir(parents=True)
    add = {"name": "codegen", "data": {"path": str(DEMO / "codegen.jsonl")}, "batch_size": 2, "context_length": 256}
    (out / "queue" / "add-codegen.json").write_text(json.dumps({**add, "at_step": 4}))
    (out / "queue" / "finish-chat.json").write_text(json.dumps({"action": "finish", "name": "chat", "at_step": 8}))


def adapters(out: Path) -> dict[str, bytes]:
    return {t: (out / "adapters" / t / "adapter_model.safetensors").read_bytes() for t in TASKS}


def one_round(fault: Fault, workload: Path, plan: Path, tmp: Path, steps: int, reference, timeout: float, log) -> str:
    """'' when the round passed, else why not; the runs' stderr goes to ``log``."""
    out = tmp / "round"
    shutil.rmtree(out, ignore_errors=True)
    queue(out)
    once = tmp / "fault.once"
    once.unlink(missing_ok=True)
    env = {**os.environ, "LORAFLEET_FAULT": fault.spec, "LORAFLEET_FAULT_ONCE": str(once)}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if fault.hog else 0)]
    extra = ["--checkpoint-every", "3", "--migration-s", "0"]
    try:
        argv = train_argv(workload, plan, out, steps, *extra, "--max-restarts", "0" if fault.resume else "1")
        run = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=log, cwd=tmp, timeout=timeout)
        if not once.exists():
            return "the fault point was never reached"
        if fault.resume:
            if run.returncode == 0:
                return "the killed run exited 0"
            run = subprocess.run(train_argv(workload, plan, out, steps, *extra, "--resume"), env=env,
                                 stdout=subprocess.DEVNULL, stderr=log, cwd=tmp, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"hung: not finished within {timeout:.0f} s"
    finally:
        for hog in hogs:
            hog.kill()
    if run.returncode != 0:
        return f"exit {run.returncode} (stderr in {log.name})"
    if steps_logged(out) != list(range(steps)):
        return f"metrics hold steps {steps_logged(out)}"
    applied = [(a["step"], a["action"], a["name"]) for a in json.loads((out / "tasks.json").read_text())["applied"]]
    if applied != [(4, "add", "codegen"), (8, "finish", "chat")]:
        return f"the ledger took {applied}"
    rows = [json.loads(line) for line in (out / "changes.jsonl").read_text().splitlines()]
    if [r["step"] for r in rows if r["kind"] == "change"] != [4, 8]:
        return f"changes.jsonl has change rows at {[r['step'] for r in rows if r['kind'] == 'change']}"
    if (out / "queue" / ".apply.json").exists():
        return "a change is left in flight"
    if adapters(out) != reference:
        return "adapters differ from the uninterrupted run's"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="stop starting rounds after this long")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--seed", type=int, default=20261206)
    parser.add_argument("--round-timeout", type=float, default=300.0, help="seconds a run may take")
    parser.add_argument("--keep", help="keep the runs under this directory")
    args = parser.parse_args()
    tmp, workload, plan = soak_setup(args.keep, "soak-changes-")
    start = time.monotonic()
    reference_out = tmp / "reference"
    queue(reference_out)
    argv = train_argv(workload, plan, reference_out, args.steps, "--checkpoint-every", "3", "--migration-s", "0")
    subprocess.run(argv, check=True, capture_output=True, cwd=tmp)
    print(f"reference run: {args.steps} steps, 2 changes, in {time.monotonic() - start:.0f} s", flush=True)
    reference = adapters(reference_out)
    passed = failed = 0
    began = time.monotonic()
    for seed in itertools.count(args.seed):
        for fault in matrix(seed):
            if time.monotonic() - began > args.minutes * 60:
                print(f"{passed} of {passed + failed} rounds ended as the uninterrupted run", flush=True)
                return 1 if failed else 0
            start = time.monotonic()
            with (tmp / f"round-{passed + failed + 1:03d}.log").open("w") as log:
                why = one_round(fault, workload, plan, tmp, args.steps, reference, args.round_timeout, log)
            passed, failed = passed + (not why), failed + bool(why)
            verdict = "ok" if not why else f"FAILED: {why}"
            print(f"round {passed + failed:3d} ({fault.describe()}): {verdict} ({time.monotonic() - start:.0f} s)",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
