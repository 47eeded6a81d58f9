"""``lorafleet train`` under a user's own multi-node torchrun (issue #17): two torchrun agents on 127.0.0.1
act as two nodes of two processes each (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous), training a
heterogeneous plan whose pipelined replica spans both nodes; its adapters equal those of the same plan
run on one node. A node of another size than the plan's ``gpus_per_node`` is one line, exit 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lorafleet.cli import build_parser, main
from lorafleet.errors import InputError
from lorafleet.plans import ReplicaSpec
from tests.helpers import fleet_harness as h
from tests.helpers.repo import DEMO, REPO
from tests.helpers.train_cli import LAUNCHER

TASKS = ("docsum", "chat")
STEPS = "3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer_dir):
    """Two nodes of 2 cpu devices; the plan ``<1,1>`` on rank 0, ``<1,2>`` on ranks 1 and 2 (its stages on
    node 0 and node 1), ``<1,1>`` on rank 3."""
    tmp = tmp_path_factory.mktemp("multinode")
    workload = tmp / "w.yaml"
    workload.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {gpu: A100-40GB, nodes: 2, gpus_per_node: 2}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 4, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 4, context_length: 128}}\n"
    )
    plan = replace(
        h.plan_of((1, 1), (1, 2), (1, 1), gpu="A100-40GB", gpus_per_node=2), tasks=TASKS, bucket_boundaries=(256,)
    )
    assert plan.replicas[1] == ReplicaSpec(1, plan.replicas[1].config, 4096, (1, 2))  # node 0 -> node 1
    plan.save(tmp / "plan.json")
    return workload, tmp / "plan.json", tmp


def _common(workload: Path, plan: Path, out: Path) -> list[str]:
    return ["train", str(workload), "--plan", str(plan), "--out", str(out), "--steps", STEPS, "--device", "cpu",
            "--no-recalibrate", "--pipeline-window", "1"]  # fmt: skip


def _adapters(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {t: load_file(out / "adapters" / t / "adapter_model.safetensors") for t in TASKS}


@pytest.mark.slow
def test_two_torchrun_agents_on_loopback_train_as_one_node_does(setup):
    workload, plan, tmp = setup
    single = tmp / "single"
    result = subprocess.run(
        [*LAUNCHER, *_common(workload, plan, single)], capture_output=True, text=True, timeout=400, cwd=tmp
    )
    assert result.returncode == 0, result.stderr[-3000:]

    multi = tmp / "multi"
    port = _free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lorafleet-test",
             "-m", "lorafleet", *_common(workload, plan, multi)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    nodes = [
        subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, env=env)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=400) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]

    steps = [json.loads(line)["step"] for line in (multi / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    reference, trained = _adapters(single), _adapters(multi)
    for task in TASKS:
        assert reference[task].keys() == trained[task].keys()
        for key, value in reference[task].items():
            torch.testing.assert_close(trained[task][key], value, rtol=1e-5, atol=1e-6)
    assert json.loads((multi / "plan.json").read_text())["replicas"][1]["gpus"] == [1, 2]


def test_a_node_of_another_size_than_the_plans_is_one_line_and_exit_2(setup, capsys, monkeypatch):
    """Four ranks as four nodes of one (``--nproc-per-node 1``) where the plan puts two on a node: refused by
    every rank before a process group forms."""
    workload, plan, tmp = setup
    for name, value in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "1"), ("RANK", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    assert main(_common(workload, plan, tmp / "refused")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "gpus_per_node: the plan puts 2 GPUs on a node; torchrun started 1 processes a node" in err
    assert "launch with --nproc-per-node 2 --nnodes 2" in err
    assert not (tmp / "refused").exists() or not any((tmp / "refused").iterdir())


def test_one_node_or_nodes_of_the_plans_size_pass_the_node_check(setup, monkeypatch):
    """All four ranks on one node (``--standalone``: the plan's TP groups are all on it) or two nodes of two
    pass; four nodes of one do not."""
    from lorafleet.plans import DeploymentPlan
    from lorafleet.train.preflight import check_nodes

    _, path, _ = setup
    plan = DeploymentPlan.load(path)
    for local in ("4", "2"):
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        check_nodes(plan, str(path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(InputError, match="gpus_per_node"):
        check_nodes(plan, str(path))


EXAMPLES = REPO / "examples" / "multinode"


def _lorafleet_argv(command: str) -> list[str]:
    """The ``lorafleet train ...`` words of a launch command line (after ``-m lorafleet``): shell line
    continuations joined, quotes stripped, a shell array (``"${RESUME[@]}"``, empty on a first run) left out."""
    words = command.replace("\\\n", " ").split()
    start = words.index("lorafleet", words.index("-m") + 1) + 1
    return [w.strip('"') for w in words[start:] if w != "\\" and "${" not in w]


def test_the_slurm_and_kubernetes_examples_launch_lorafleet_train_under_torchrun():
    """Each example runs torchrun with c10d rendezvous, ``--nproc-per-node`` equal to its workload's
    ``gpus_per_node``, and a ``lorafleet train`` command line the CLI parses."""
    workload = yaml.safe_load((EXAMPLES / "workload.yaml").read_text())
    per_node = workload["cluster"]["gpus_per_node"]
    sbatch = (EXAMPLES / "train.sbatch").read_text()
    assert f"#SBATCH --nodes={workload['cluster']['nodes']}" in sbatch
    assert f"#SBATCH --gpus-per-node={per_node}" in sbatch
    commands = [sbatch[sbatch.index("srun --") :]]
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in sbatch  # a fresh store every restart (issue #25)
    for manifest in ("pytorchjob.yaml", "trainjob.yaml"):
        documents = list(yaml.safe_load_all((EXAMPLES / manifest).read_text()))
        text = json.dumps(documents)
        assert '{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}' in text, manifest
        assert f"nproc-per-node={per_node}" in text or f'"numProcPerNode": {per_node}' in text, manifest
        commands += [" ".join(c["command"]) for c in _containers(documents)]
    for command in commands:
        assert "torchrun" in command and "--rdzv-backend=c10d" in command, command
        assert f"--nproc-per-node={per_node}" in command, command
        args = build_parser().parse_args(_lorafleet_argv(command))
        assert args.command == "train" and args.workload.endswith("workload.yaml") and args.plan.endswith("plan.json")


def _containers(documents: list) -> list[dict]:
    """Every container (with a command) of the manifests' pod templates."""
    found = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "command" in node and "image" in node:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(documents)
    assert found
    return found
