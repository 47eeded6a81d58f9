"""``lorafleet train``: input errors before any process starts, the CLI surface, one real run."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import peft
import pytest
from safetensors import safe_open

import fleet_harness as h
from lorafleet.cli import build_parser, main
from lorafleet.executor.torch.base_model import load_causal_lm

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo"


def test_cli_surface_is_frozen():
    """A new option must be added here on purpose (torchtitan's test_no_new_cli_options)."""
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    options = sorted(o for a in train._actions for o in a.option_strings)
    assert options == [
        "--alignment",
        "--buckets",
        "--checkpoint-every",
        "--choose-buckets-by-makespan",
        "--device",
        "--dtype",
        "--gap",
        "--gpu",
        "--gpus",
        "--help",
        "--inject-slowdown",
        "--max-restarts",
        "--method",
        "--microbatch",
        "--no-progress",
        "--no-recalibrate",
        "--no-stop-checkpoint",
        "--nonfinite-patience",
        "--out",
        "--overwrite",
        "--plan",
        "--profile",
        "--recalibrate",
        "--resume",
        "--solver",
        "--steps",
        "--time-limit",
        "-h",
    ]


@pytest.fixture
def workload(tmp_path, tiny_tokenizer_dir):
    """Two demo tasks on tiny-llama (the project's tiny tokenizer), and a two-replica plan for
    them, the second recomputing activations."""
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {gpu: A100-40GB, nodes: 1, gpus_per_node: 2}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128}}\n"
    )
    plan = replace(h.plan_of((1, 1), (1, 1, True)), gpu="A100-40GB", tasks=("docsum", "chat"), bucket_boundaries=(256,))
    plan.save(tmp_path / "plan.json")
    return path, tmp_path / "plan.json"


def _without_data(text: str) -> str:
    """The workload with the first task planned from lengths only (no training data)."""
    start = text.index("data: {path:")
    return text[:start] + "lengths: {values: [5]}" + text[text.index("}", start) + 1 :]


@pytest.mark.parametrize(
    "change,extra,message",
    [
        (_without_data, [], "training needs data for every task; docsum has none"),
        (None, ["--steps", "0"], "--steps: must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(workload, capsys, change, extra, message):
    path, plan = workload
    if change is not None:
        path.write_text(change(path.read_text()))
    assert main(["train", str(path), "--plan", str(plan), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a_plan_for_other_tasks_is_refused(workload, capsys, tmp_path):
    path, plan = workload
    other = replace(h.plan_of((1, 1)), gpu="A100-40GB", tasks=("a", "b"), bucket_boundaries=(256,))
    other.save(tmp_path / "other.json")
    assert main(["train", str(path), "--plan", str(tmp_path / "other.json")]) == 2
    assert "the plan is for tasks ['a', 'b']" in capsys.readouterr().err


@pytest.mark.slow
def test_train_runs_under_torchrun_and_writes_adapters_metrics_checkpoints(workload, tmp_path):
    """One run checks the files and, in bf16, that a bf16 base trains fp32 master adapters: the losses
    are finite and the exported PEFT adapters are fp32."""
    out = tmp_path / "out"
    result = _train(workload, out, "--steps", "3", "--checkpoint-every", "2", "--dtype", "bf16")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert all(
        set(r["losses"]) == {"docsum", "chat"}
        and r["tokens_per_s"] > 0
        and len(r["replica_busy_s"]) == 2
        and len(r["predicted_busy_s"]) == 2
        for r in lines
    )
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert [float(r["loss/chat"]) for r in rows] == [r["losses"]["chat"] for r in lines]
    assert all(max(float(r[f"predicted_busy_s/{i}"]) for i in (0, 1)) > 0 for r in rows)
    assert all(
        float(r["correction/0"]) > 0 and float(r["model_busy_s/0"]) > 0 and float(r["cpu_s/rank_0"]) > 0 for r in rows
    )
    assert (out / "plan.json").is_file() and not (out / ".stop-request").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "\x1b[" not in result.stdout  # stdout is a pipe here: no progress bar
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == 3
    assert (out / "checkpoints" / "step-000002").is_dir()
    for task in ("docsum", "chat"):
        peft.PeftModel.from_pretrained(load_causal_lm(h.TINY), out / "adapters" / task)
        with safe_open(out / "adapters" / task / "adapter_model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert all(math.isfinite(v) and v > 0 for r in lines for v in r["losses"].values())


def _train(workload: tuple[Path, Path], out: Path, *options: str) -> subprocess.CompletedProcess:
    """``lorafleet train`` on gloo as a user runs it (it re-runs itself under torchrun); must succeed."""
    path, plan = workload
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lorafleet",
            "train",
            str(path),
            "--plan",
            str(plan),
            "--out",
            str(out),
            "--device",
            "cpu",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_slowed_replica_gets_less_work_on_the_torch_executor(tmp_path, tiny_tokenizer_dir):
    """Two identical TP1 replicas priced by the shipped CPU profile, which splits the work evenly between
    them; replica 0 is made 4x slower by an injected wait. The probe before the first step (a micro-batch
    of each replica's share timed twice, not trained on) already sees it, so from step 0 on replica 0
    holds far fewer tokens than its peer, and every step's report keeps it so."""
    from lorafleet.costmodel import CostModelOrigin, file_sha256

    profile = REPO / "profiles" / "tiny-llama-cpu.json"
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 2}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 8, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 8, context_length: 128}}\n"
    )
    plan = replace(
        h.plan_of((1, 1), (1, 1), max_tokens=1024),
        gpu="cpu",
        tasks=("docsum", "chat"),
        bucket_boundaries=(256,),
        cost_model=CostModelOrigin(kind="profile", gpu="cpu", profile=str(profile), sha256=file_sha256(profile)),
    )
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    _train((path, tmp_path / "plan.json"), out, "--steps", "4", "--inject-slowdown", "0=4")
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    model = [float(r["model_busy_s/0"]) / float(r["model_busy_s/1"]) for r in rows]
    share = [float(r["replica_tokens/0"]) / float(r["replica_tokens/1"]) for r in rows]
    corrections = [float(r["correction/0"]) / float(r["correction/1"]) for r in rows]
    assert min(corrections) > 2.5, corrections  # the probe saw it (step 0's report, warm-up, is left out)
    assert max(share) < 0.6, share  # an even split would be ~1 (the uncorrected model prices them alike)
    assert max(model) < 0.6, model  # what the model says of those very micro-batches: replica 0 was given less
