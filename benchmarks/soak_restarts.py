"""Soak automatic restarts: seeded worker SIGKILLs under ``--max-restarts``, each run checked bitwise.

Each round trains the same tiny-llama workload (two tasks, 2 gloo ranks on one plan, CPU,
``--no-recalibrate``: the dispatch is then a function of the step alone) for ``--steps`` steps with
``--max-restarts 2`` and kills one worker once, at a seeded point:

- ``rank``: rank 0 or rank 1 (read from the process's environment);
- ``when``: ``step`` (a seeded delay after a seeded step's metrics line: mid-step or at a boundary),
  ``writing`` (the moment a checkpoint's ``.partial`` directory appears: mid-write), ``committed``
  (the moment a new step directory is committed: right after a write);
- ``hog``: two busy-looping processes on the machine's cores for the whole round, or none.

A round passes when the run exits 0 within ``--round-timeout`` seconds, its metrics count every step
once, and every adapter equals the uninterrupted reference run's bitwise. The script prints a line per
round and the tally; exit code 1 unless every round passed. ``scripts/soak_restarts.sh`` runs 50 rounds.

    python benchmarks/soak_restarts.py --rounds 50 --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo"
LAUNCHER = [sys.executable, "-m", "lorafleet"]
TASKS = ("docsum", "chat")


@dataclass(frozen=True)
class Fault:
    """One round's kill."""

    rank: int
    when: str
    step: int
    delay_s: float
    hog: bool

    def describe(self) -> str:
        at = (
            f"step {self.step} + {self.delay_s:.2f} s" if self.when == "step" else f"{self.when} after step {self.step}"
        )
        return f"rank {self.rank}, {at}{', CPU hog' if self.hog else ''}"


def faults(rounds: int, steps: int, seed: int) -> list[Fault]:
    """``rounds`` seeded faults covering both ranks, every kill point, with and without a CPU hog."""
    rng = random.Random(seed)
    whens = ("step", "writing", "committed")
    return [
        Fault(
            rank=k % 2,
            when=whens[(k // 2) % 3],
            step=rng.randrange(2, steps - 3),
            delay_s=rng.uniform(0.0, 1.5),
            hog=(k // 6) % 2 == 1,
        )
        for k in range(rounds)
    ]


def write_workload(tmp: Path) -> Path:
    from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tmp / "tokenizer")
    path = tmp / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tokenizer}\n"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 2}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128}}\n"
    )
    return path


def soak_setup(keep: str | None, prefix: str) -> tuple[Path, Path, Path]:
    """A soak's directory (``keep``, or a fresh temporary one named ``prefix...``), its workload and the plan of it
    on 2 GPUs: (directory, workload, plan)."""
    tmp = Path(keep or tempfile.mkdtemp(prefix=prefix))
    tmp.mkdir(parents=True, exist_ok=True)
    workload = write_workload(tmp)
    plan = tmp / "plan.json"
    subprocess.run([*LAUNCHER, "plan", str(workload), "--json", str(plan), "--samples", "0", "--gpus", "2"],
                   check=True, capture_output=True, cwd=tmp)  # fmt: skip
    return tmp, workload, plan


def train_argv(workload: Path, plan: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [*LAUNCHER, "train", str(workload), "--plan", str(plan), "--out", str(out), "--device", "cpu",
            "--no-recalibrate", "--steps", str(steps), "--gpus", "2", "--no-progress", *extra]  # fmt: skip


def adapters(out: Path) -> dict[str, bytes]:
    return {t: (out / "adapters" / t / "adapter_model.safetensors").read_bytes() for t in TASKS}


def steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def worker_ranks(out: Path) -> dict[int, int]:
    """rank -> pid of the run's worker processes (``python -m lorafleet.train.rank <out>/run.json``)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lorafleet.train.rank" in cmdline and str(out / "run.json").encode() in cmdline:
            env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
            if b"RANK" in env:
                found[int(env[b"RANK"])] = int(entry.name)
    return found


def wait_for_kill_point(fault: Fault, out: Path, process: subprocess.Popen, deadline: float) -> bool:
    """Block until the fault's moment (False: the run ended or the deadline passed first)."""
    checkpoints = out / "checkpoints"

    def step_dirs() -> set[str]:
        return {p.name for p in checkpoints.glob("step-*")} if checkpoints.is_dir() else set()

    while time.monotonic() < deadline and process.poll() is None:
        if len(steps_logged(out)) > fault.step:
            break
        time.sleep(0.02)
    else:
        return False
    if fault.when == "step":
        time.sleep(fault.delay_s)
        return process.poll() is None
    before = step_dirs()
    while time.monotonic() < deadline and process.poll() is None:
        if fault.when == "writing" and checkpoints.is_dir() and any(checkpoints.glob(".step-*.partial")):
            return True
        if fault.when == "committed" and step_dirs() - before:
            return True
        time.sleep(0.002)
    return False


def one_round(
    fault: Fault, workload: Path, plan: Path, tmp: Path, steps: int, reference: dict[str, bytes], timeout: float, log
) -> str:
    """'' when the round passed, else why not; the run's stderr goes to ``log``."""
    out = tmp / "round"
    shutil.rmtree(out, ignore_errors=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if fault.hog else 0)]
    process = subprocess.Popen(
        train_argv(workload, plan, out, steps, "--checkpoint-every", "2", "--max-restarts", "2"),
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
        cwd=tmp,
    )
    deadline = time.monotonic() + timeout
    try:
        if not wait_for_kill_point(fault, out, process, deadline):
            return "the run ended or stalled before the kill point"
        pid = worker_ranks(out).get(fault.rank)
        if pid is None:
            return f"no rank {fault.rank} process to kill"
        os.kill(pid, signal.SIGKILL)
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()  # the launcher: torchrun and the workers die with it (parent-death signal)
            process.wait()
            return f"hung: not finished within {timeout:.0f} s"
    finally:
        for hog in hogs:
            hog.kill()
        for pid in worker_ranks(out).values():  # none should be left; never let one leak into the next round
            with contextlib.suppress(ProcessLookupError):  # it may end between the listing and the kill
                os.kill(pid, signal.SIGKILL)
    if process.returncode != 0:
        return f"exit {process.returncode} (stderr in {log.name})"
    if steps_logged(out) != list(range(steps)):
        return f"metrics hold steps {steps_logged(out)}"
    if adapters(out) != reference:
        return "adapters differ from the uninterrupted run's"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--round-timeout", type=float, default=300.0, help="seconds a round may take")
    parser.add_argument("--keep", help="keep the runs under this directory")
    args = parser.parse_args()
    tmp, workload, plan = soak_setup(args.keep, "soak-restarts-")
    start = time.monotonic()
    subprocess.run(train_argv(workload, plan, tmp / "reference", args.steps), check=True, capture_output=True, cwd=tmp)
    print(f"reference run: {args.steps} steps in {time.monotonic() - start:.0f} s", flush=True)
    reference = adapters(tmp / "reference")
    failed = 0
    for k, fault in enumerate(faults(args.rounds, args.steps, args.seed)):
        start = time.monotonic()
        with (tmp / f"round-{k + 1:02d}.log").open("w") as log:
            why = one_round(fault, workload, plan, tmp, args.steps, reference, args.round_timeout, log)
        failed += bool(why)
        verdict = "ok" if not why else f"FAILED: {why}"
        print(f"round {k + 1:2d} ({fault.describe()}): {verdict} ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"{args.rounds - failed} of {args.rounds} rounds recovered bitwise", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
