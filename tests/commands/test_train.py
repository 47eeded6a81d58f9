"""``lorafleet train``: input errors before any process starts, the CLI surface, one real run."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import peft
import pytest
from safetensors import safe_open

from lorafleet.cli import build_parser, main
from lorafleet.executor.torch.base_model import load_causal_lm
from lorafleet.plans import DeploymentPlan
from tests.helpers import fleet_harness as h
from tests.helpers.repo import DEMO, REPO


def test_cli_surface_is_frozen():
    """A new option must be added here on purpose (torchtitan's test_no_new_cli_options)."""
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    options = sorted(o for a in train._actions for o in a.option_strings)
    assert options == [
        "--alignment",
        "--allow-changes",
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
        "--logger",
        "--max-restarts",
        "--method",
        "--microbatch",
        "--migration-s",
        "--no-progress",
        "--no-recalibrate",
        "--no-stop-checkpoint",
        "--nonfinite-patience",
        "--out",
        "--overwrite",
        "--pipeline-window",
        "--plan",
        "--profile",
        "--queue",
        "--queue-data-root",
        "--queue-http",
        "--recalibrate",
        "--replan-after",
        "--replan-horizon",
        "--replan-objective",
        "--replan-samples",
        "--resume",
        "--set",
        "--solver",
        "--start-timeout",
        "--steps",
        "--time-limit",
        "-h",
    ]


@pytest.fixture
def workload(tmp_path, tiny_tokenizer_dir):
    """Two demo tasks on tiny-llama (the project's tiny tokenizer), chat evaluated every 2 steps on 5% of its rows,
    and a two-replica plan for them, the second recomputing activations."""
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 2}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128,\n"
        "      eval: {split: 0.05, every_steps: 2}}\n"
    )
    plan = replace(h.plan_of((1, 1), (1, 1, True)), tasks=("docsum", "chat"), bucket_boundaries=(256,))
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
        (None, ["--logger", "comet"], "--logger: expected one of wandb, mlflow, got 'comet'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(workload, capsys, change, extra, message):
    path, plan = workload
    if change is not None:
        path.write_text(change(path.read_text()))
    assert main(["train", str(path), "--plan", str(plan), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_weights_no_worker_could_load_are_refused_before_any_process(workload, capsys, tmp_path):
    """A preset without weights on this machine, or a safetensors file cut short, is one line naming the
    workload or the file, exit 2, and nothing written: not the same error in every worker."""
    path, plan = workload
    model = tmp_path / "model"
    h.build_model("llama").save_pretrained(model, safe_serialization=True)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    capsys.readouterr()  # transformers' progress bar
    out = tmp_path / "out"
    for name, words in (
        (model, f"{weights}: not a readable safetensors file (Error while deserializing header"),
        ("llama2-7b", f"{path}: model: preset 'llama2-7b' has no weights on this machine"),
    ):
        path.write_text(re.sub(r"^model: .*$", f"model: {name}", path.read_text(), flags=re.M))
        fitted = DeploymentPlan.load(plan)  # the weights are checked after the plan: one the CPU model holds
        fitted = replace(fitted, model=str(name), replicas=tuple(replace(r, max_tokens=512) for r in fitted.replicas))
        fitted.save(plan)
        assert main(["train", str(path), "--plan", str(plan), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err
        assert not out.exists()


def test_a_plan_for_other_tasks_is_refused(workload, capsys, tmp_path):
    path, plan = workload
    other = replace(h.plan_of((1, 1)), tasks=("a", "b"), bucket_boundaries=(256,))
    other.save(tmp_path / "other.json")
    assert main(["train", str(path), "--plan", str(tmp_path / "other.json")]) == 2
    assert "the plan is for tasks ['a', 'b']" in capsys.readouterr().err


def test_a_gpu_plan_on_the_cpu_device_is_refused_before_any_process(workload, capsys, tmp_path):
    """#29: on CPU a rank's device kind is ``cpu``; ``--device cpu`` with a plan for A100s is one line, exit 2,
    and nothing written (on GPUs each rank checks its own: tests/executor/torch/test_device_kind.py)."""
    path, _ = workload
    path.write_text(path.read_text().replace("gpu: cpu", "gpu: A100-40GB"))
    plan = replace(h.plan_of((1, 1), (1, 1), gpu="A100-40GB"), tasks=("docsum", "chat"), bucket_boundaries=(256,))
    plan.save(tmp_path / "a100.json")
    out = tmp_path / "out"
    assert main(["train", str(path), "--plan", str(tmp_path / "a100.json"), "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "a100.json: pools[0].gpu: --device cpu runs every rank on a CPU, but the plan puts ranks in " in err
    assert "of A100-40GB GPUs: plan for the devices the job runs on (--gpu cpu)" in err
    assert not out.exists()


@pytest.mark.slow
def test_train_runs_under_torchrun_and_writes_adapters_metrics_checkpoints(workload, tmp_path, monkeypatch):
    """One run checks the files and, in bf16, that a bf16 base trains fp32 master adapters: the losses
    are finite and the exported PEFT adapters are fp32. Its stdout, a pipe, tells the start-up phases and
    then a line per step as the step ends (a plan without pipelined replicas runs a step a window); the
    W&B (offline) and MLflow (file store) loggers get the step scalars, MLflow chat's eval losses at the steps
    they followed."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    result = _train(
        workload,
        out,
        *("--steps", "3", "--checkpoint-every", "2", "--dtype", "bf16", "--logger", "wandb", "--logger", "mlflow"),
        env=offline,
    )
    said = [line for _, line in result.lines]
    phases = [re.sub(r"^lorafleet train: \[ *[0-9.]+s\] ", "", line).strip() for line in said if "s] " in line]
    assert phases[0] == "checked: 2 tasks, <1,1> x 1 + <1,1,rc> x 1 on 2 GPUs"
    assert phases[1] == "starting 2 worker processes (torchrun)"
    assert phases[2] == "process group up: 2 ranks (gloo)"
    assert re.fullmatch(r"tokenized: 2 tasks, [0-9,]+ examples, [0-9,]+ tokens", phases[3]), phases[3]
    assert re.fullmatch(r"base model loaded: tiny-llama, [0-9.]+M parameters, bfloat16", phases[4]), phases[4]
    assert phases[5] == "training steps 0..2 of 3"
    steps = [(t, line) for t, line in result.lines if re.match(r"step [0-9]+/3  loss ", line)]
    assert [line.split()[1] for _, line in steps] == ["1/3", "2/3", "3/3"]
    assert all(re.search(r"ETA [0-9]+m[0-9]{2}s$", line.strip()) for _, line in steps)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # each line came as its step ended: the first and the last are apart by at least half of the two steps
    # between them (lines held back until the end, as 8-step windows did, come together)
    between = lines[1]["makespan_s"] + lines[2]["makespan_s"]
    assert steps[2][0] - steps[0][0] >= 0.5 * between, (steps, between)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when allowed
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run_id = (out / ".mlflow-run-id").read_text().strip()
    assert [m.step for m in client.get_metric_history(run_id, "loss/chat")] == [0, 1, 2]
    assert client.get_run(run_id).data.params["gpus"] == "2"
    assert len(list(out.glob("wandb/offline-run-*/run-*.wandb"))) == 1
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
    # chat is evaluated after steps 2 and 3, its first pass predicted by the launch probe's forward (train.probe)
    assert [r["step"] for r in lines if "eval_s" in r] == [1, 2] and lines[1]["eval_predicted_s"] > 0
    evaluated = [(r["step"], r["eval_loss"]["chat"]) for r in lines if "eval_loss" in r]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval_loss/chat")] == evaluated


@dataclass(frozen=True)
class Run:
    """A finished ``lorafleet train``: its exit code, stderr, and each stdout line with when it arrived."""

    returncode: int
    stderr: str
    lines: tuple[tuple[float, str], ...]

    @property
    def stdout(self) -> str:
        return "".join(line for _, line in self.lines)


def _train(workload: tuple[Path, Path], out: Path, *options: str, env: dict | None = None) -> Run:
    """``lorafleet train`` on gloo as a user runs it (it re-runs itself under torchrun), its stdout a pipe
    read line by line as it comes (as nohup or a pod's log would take it); must succeed."""
    path, plan = workload
    argv = [sys.executable, "-m", "lorafleet", "train", str(path), "--plan", str(plan), "--out", str(out)]
    with tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            [*argv, "--device", "cpu", *options],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=out.parent,
            env={**os.environ, **(env or {})},
        )
        lines = []
        deadline = time.monotonic() + 900
        for line in process.stdout:
            lines.append((time.monotonic(), line))
            assert time.monotonic() < deadline, "lorafleet train ran past 900 s"
        returncode = process.wait(timeout=60)
        err.seek(0)
        run = Run(returncode, err.read(), tuple(lines))
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_a_slowed_replica_gets_less_work_on_the_torch_executor(tmp_path, tiny_tokenizer_dir):
    """Two identical TP1 replicas priced by the shipped CPU profile, which splits the work evenly between
    them; replica 0 is made 8x slower by an injected wait. The probe before the first step (a micro-batch
    of each replica's share, its fastest of two timed passes, not trained on) already sees it, so from
    step 0 on replica 0 is priced slower and holds fewer tokens than its peer, and the steps' reports
    keep it so."""
    from lorafleet.costmodel import CostModelOrigin
    from lorafleet.specs.io import file_sha256

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
    origin = CostModelOrigin(kind="profile", gpu="cpu", profile=str(profile), sha256=file_sha256(profile))
    plan = replace(
        h.plan_of((1, 1), (1, 1), max_tokens=1024, cost_model=origin),
        tasks=("docsum", "chat"),
        bucket_boundaries=(256,),
    )
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    _train((path, tmp_path / "plan.json"), out, "--steps", "4", "--inject-slowdown", "0=8")
    rows = list(csv.DictReader((out / "metrics.csv").open()))

    def ratio(column: str) -> list[float]:
        return [float(r[f"{column}/0"]) / float(r[f"{column}/1"]) for r in rows]

    # The factors each step was dispatched with (corrected over uncorrected estimate), not those after it:
    # steps 0 and 1 are priced by the probe alone (a dispatch looks a step ahead, the first step's report is
    # left out). Uncorrected they would be ~1. Not 8: the wait slows replica 0's compute, not the step's
    # collectives, which weigh more the less replica 0 holds (at 4x: 1.7-5.2 per step, down to ~1.3 in a loaded CI).
    priced = [p / m for p, m in zip(ratio("predicted_busy_s"), ratio("model_busy_s"), strict=True)]
    assert min(priced) > 2.0, priced
    # Each step's dispatch balances those prices, so replica 0 holds far less; an even split is ~1 (the
    # uncorrected model prices the two alike), and one long sequence moves a split by ~0.15.
    for held in (ratio("replica_tokens"), ratio("model_busy_s")):
        assert max(held) < 0.8 and statistics.median(held) < 0.6, (held, priced)
