"""``lorafleet train --device cuda``: one process under torchrun, NCCL, a tiny-llama replica on the GPU
(its LoRA layers on the Triton backend, which AUTO picks for CUDA tensors). CPU twin: the same run
on gloo, ``tests/commands/test_train.py``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec
from tests.helpers.repo import EXAMPLES, REPO

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CPU twin: tests/commands/test_train.py, gloo)",
)

DEMO = EXAMPLES / "demo"
STEPS = 6


@pytest.fixture
def workload(tmp_path, tiny_tokenizer_dir):
    """Two demo tasks on tiny-llama (the project's tiny tokenizer) and a plan of one TP1 replica on GPU 0."""
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {gpu: H200-141GB, nodes: 1, gpus_per_node: 1}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128}}\n"
    )
    plan = DeploymentPlan(
        model="tiny-llama",
        pools=(PlanPool("", "H200-141GB", 1, 1),),
        tasks=("docsum", "chat"),
        replicas=(ReplicaSpec(0, ParallelConfig(1, 1), 4096, (0,)),),
        bucket_boundaries=(),
        expected_makespan_s=0.0,
    )
    plan.save(tmp_path / "plan.json")
    return path, tmp_path / "plan.json"


def test_nccl_training_steps_and_changes_the_adapters(workload, tmp_path):
    path, plan = workload
    out = tmp_path / "out"
    # lorafleet need not be installed (the GPU machine runs the checkout): the torchrun workers find it here.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lorafleet",
            "train",
            str(path),
            "--plan",
            str(plan),
            "--steps",
            str(STEPS),
            "--out",
            str(out),
            "--device",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    losses = {task: [r["losses"][task] for r in lines] for task in ("docsum", "chat")}
    assert all(math.isfinite(v) and v > 0 for series in losses.values() for v in series), losses
    for task in ("docsum", "chat"):
        weights = load_file(out / "adapters" / task / "adapter_model.safetensors")
        b = [t for name, t in weights.items() if "lora_B" in name]
        assert b and all(torch.isfinite(t).all() for t in weights.values()), task
        assert any(t.abs().max() > 0 for t in b), f"{task}: every lora_B is still zero after {STEPS} steps"
    print(f"losses per step: {losses}")
