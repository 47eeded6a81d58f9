"""Automatic recovery and elastic re-planning (DLRover's, on torchrun's elastic agent), end to end.

- Workers SIGKILLed at seeded random points (start-up, mid-step, mid-checkpoint-write) under
  ``--max-restarts``: torchrun restarts them, they resume from the newest intact checkpoint, and
  the final adapters are bitwise those of an uninterrupted run (CPU, recalibration off: the
  dispatch is then a function of the step alone).
- A run stopped halfway (SIGINT, at a step boundary) and resumed on fewer or more GPUs (4 -> 2,
  2 -> 4) re-plans for them with the run's cost model and policy and continues on the same data
  order; the adapters equal an uninterrupted run's to float tolerance (another plan sums
  gradients in another order). The first part is told the run's total steps, as a resume is:
  the learning-rate schedules span ``--steps``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_reliability import DEMO, LAUNCHER, _steps, _wait_for_steps, _worker_pids

TASKS = ("docsum", "chat")


def _workload(tmp: Path, tokenizer: Path, gpus_per_node: int = 2) -> Path:
    path = tmp / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tokenizer}\n"
        f"cluster: {{gpu: cpu, nodes: 1, gpus_per_node: {gpus_per_node}}}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128}}\n"
    )
    return path


def _plan(workload: Path, out: Path, *args: str) -> Path:
    subprocess.run([*LAUNCHER, "plan", str(workload), "--json", str(out), "--samples", "0", *args], check=True,
                   capture_output=True, cwd=out.parent)
    return out


def _train(workload: Path, plan: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([*LAUNCHER, "train", str(workload), "--plan", str(plan), "--out", str(out), "--device", "cpu",
                             "--no-recalibrate", *args], capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _adapters(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {t: load_file(out / "adapters" / t / "adapter_model.safetensors") for t in TASKS}


@pytest.mark.slow
def test_random_worker_kills_recover_to_the_bitwise_same_adapters(tmp_path, tiny_tokenizer_dir):
    workload = _workload(tmp_path, tiny_tokenizer_dir)
    plan = _plan(workload, tmp_path / "plan.json")
    steps = "24"
    _train(workload, plan, tmp_path / "reference", "--steps", steps)
    out = tmp_path / "faulty"
    process = subprocess.Popen([*LAUNCHER, "train", str(workload), "--plan", str(plan), "--out", str(out), "--device",
                                "cpu", "--no-recalibrate", "--steps", steps, "--checkpoint-every", "1", "--max-restarts",
                                "16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    rng = random.Random(20261201)
    kills, deadline = 0, time.monotonic() + 480
    while process.poll() is None and kills < 10 and time.monotonic() < deadline:
        pids = _worker_pids(str(out))
        if len(pids) < 2:
            time.sleep(0.05)
            continue
        time.sleep(rng.uniform(0.0, 3.0))  # start-up (import, model build), a step, or a checkpoint write
        pids = _worker_pids(str(out))
        if pids:
            os.kill(rng.choice(sorted(pids)), signal.SIGKILL)
            kills += 1
            while set(_worker_pids(str(out))) & set(pids) and process.poll() is None:
                time.sleep(0.05)  # the old workers are gone before the next round looks
    stdout, stderr = process.communicate(timeout=max(30.0, deadline - time.monotonic()))
    assert kills >= 10, f"only {kills} kills before the run ended"
    assert process.returncode == 0, stderr[-3000:]
    assert _steps(out) == list(range(int(steps)))  # replayed steps are counted once
    reference, recovered = _adapters(tmp_path / "reference"), _adapters(out)
    for task in TASKS:
        assert reference[task].keys() == recovered[task].keys()
        assert all(torch.equal(reference[task][k], recovered[task][k]) for k in reference[task]), task


@pytest.mark.slow
def test_a_resume_on_other_gpus_replans_and_continues(tmp_path, tiny_tokenizer_dir):
    """4 -> 2 and 2 -> 4 GPUs halfway through, against an uninterrupted run on 4."""
    workload = _workload(tmp_path, tiny_tokenizer_dir, gpus_per_node=4)
    four = _plan(workload, tmp_path / "four.json", "--gpus", "4")
    two = _plan(workload, tmp_path / "two.json", "--gpus", "2")
    _train(workload, four, tmp_path / "reference", "--steps", "4", "--gpus", "4")
    reference = _adapters(tmp_path / "reference")
    cases = {"shrink": (four, "4", "2", signal.SIGINT), "grow": (two, "2", "4", signal.SIGTERM)}
    for name, (first, gpus, then, sig) in cases.items():
        out = tmp_path / name
        part = subprocess.Popen([*LAUNCHER, "train", str(workload), "--plan", str(first), "--out", str(out), "--device",
                                 "cpu", "--no-recalibrate", "--steps", "4", "--gpus", gpus], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        _wait_for_steps(out, 1, part)
        part.send_signal(sig)
        stdout, stderr = part.communicate(timeout=300)
        assert part.returncode == 128 + sig and f"stopped by {sig.name} after" in stdout, stderr[-3000:]
        assert "Traceback" not in stderr
        resumed = _train(workload, first, out, "--steps", "4", "--resume", "--gpus", then)
        assert f"re-planned for {then} GPUs: " in resumed.stdout, resumed.stdout
        assert _steps(out) == [0, 1, 2, 3]
        ours = _adapters(out)
        for task in TASKS:
            for key, value in reference[task].items():
                torch.testing.assert_close(ours[task][key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {task} {key}")
