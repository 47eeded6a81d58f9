"""Checkpoint files: PEFT layout, atomic commit, and what a loader trusts."""

from __future__ import annotations

import json

import pytest
import torch

from lorafleet.errors import InputError
from lorafleet.executor.torch.checkpoint import (
    LATEST,
    TaskState,
    TrainState,
    latest_step_dir,
    load_train_state,
    save_train_state,
)
from lorafleet.specs.lora import LoraSpec

SPEC = LoraSpec(rank=2, alpha=4, target_modules=("q_proj",))
MODULE = "model.layers.0.self_attn.q_proj"


def _state(step: int, value: float) -> TrainState:
    weights = {(MODULE, "lora_A"): torch.full((2, 64), value), (MODULE, "lora_B"): torch.full((64, 2), -value)}
    moments = {
        (MODULE, "lora_A", "exp_avg"): torch.full((2, 64), value / 2),
        (MODULE, "lora_A", "step"): torch.tensor(3.0),
    }
    return TrainState(
        step,
        (TaskState("t", SPEC, weights, moments, optimizer_steps=step),),
        {"step": step, "cursors": [step]},
        {"dispatch": "state"},
    )


def test_round_trip(tmp_path):
    save_train_state(tmp_path, _state(2, 0.5), base_model="tiny-llama")
    loaded = load_train_state(latest_step_dir(tmp_path), ["t"])
    assert loaded.step == 2 and loaded.data == {"step": 2, "cursors": [2]} and loaded.extra == {"dispatch": "state"}
    (task,) = loaded.tasks
    assert task.spec == SPEC and task.optimizer_steps == 2
    assert torch.equal(task.weights[(MODULE, "lora_B")], torch.full((64, 2), -0.5))
    assert torch.equal(task.optimizer[(MODULE, "lora_A", "step")], torch.tensor(3.0))
    config = json.loads((latest_step_dir(tmp_path) / "t" / "adapter_config.json").read_text())
    assert (
        config["r"] == 2
        and config["target_modules"] == ["q_proj"]
        and config["base_model_name_or_path"] == "tiny-llama"
    )


def test_only_committed_checkpoints_count_and_old_ones_go(tmp_path):
    for step in (1, 2, 3):
        save_train_state(tmp_path, _state(step, float(step)), base_model="m", keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    # A crash after writing step 4 but before the rename leaves a partial directory: ignored.
    partial = tmp_path / ".step-000004.partial"
    partial.mkdir()
    (partial / "junk").write_text("half")
    assert latest_step_dir(tmp_path).name == "step-000003"
    # A crash after the rename but before latest.json moves: step 3 still in force, and a re-save cleans up.
    save_train_state(tmp_path, _state(4, 4.0), base_model="m")
    assert json.loads((tmp_path / LATEST).read_text())["step"] == 4 and not partial.exists()
    assert latest_step_dir(tmp_path / "nowhere") is None


def test_a_checkpoint_of_other_tasks_is_an_input_error(tmp_path):
    save_train_state(tmp_path, _state(1, 1.0), base_model="m")
    with pytest.raises(InputError, match="checkpoint has tasks"):
        load_train_state(latest_step_dir(tmp_path), ["t", "u"])


@pytest.mark.parametrize(
    "damage", ["truncate tensor", "truncate manifest", "drop optimizer", "garble pointer", "manifest of another step"]
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact(tmp_path, damage):
    from lorafleet.runtime.checkpoint_files import resumable_checkpoint

    for step in (1, 2):
        save_train_state(tmp_path, _state(step, float(step)), base_model="m")
    newest = tmp_path / "step-000002"
    if damage == "truncate tensor":
        tensor = newest / "t" / "adapter_model.safetensors"
        tensor.write_bytes(tensor.read_bytes()[:-7])
    elif damage == "truncate manifest":
        manifest = newest / "manifest.json"
        manifest.write_text(manifest.read_text()[:40])
    elif damage == "drop optimizer":
        (newest / "t" / "optimizer.safetensors").unlink()
    elif damage == "manifest of another step":  # its files all match their checksums
        manifest = newest / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "step": 7}))
    else:
        (tmp_path / LATEST).write_text('{"step": 2, "pa')
    found = resumable_checkpoint(tmp_path)
    if damage == "garble pointer":  # the pointer is a hint: the newest intact directory wins
        assert found.step == 2 and found.broken == ()
        return
    assert found.step == 1 and found.step_dir.name == "step-000001"
    assert len(found.broken) == 1 and found.broken[0].startswith("step-000002: ")
    if damage == "manifest of another step":
        assert found.broken[0] == "step-000002: its manifest says step 7, its directory's name step-000002"
    assert load_train_state(found.step_dir, ["t"]).step == 1


def test_no_intact_checkpoint_is_one_input_error(tmp_path):
    from lorafleet.runtime.checkpoint_files import resumable_checkpoint

    save_train_state(tmp_path, _state(1, 1.0), base_model="m")
    (tmp_path / "step-000001" / "manifest.json").write_text("{")
    with pytest.raises(InputError, match="no intact checkpoint to resume from \\(step-000001: unreadable manifest"):
        resumable_checkpoint(tmp_path)


def test_adapter_export_replaces_a_directory_whole(tmp_path):
    from lorafleet.runtime.checkpoint_files import export_adapters

    save_train_state(tmp_path / "ckpt", _state(3, 3.0), base_model="m")
    target = tmp_path / "adapters"
    (target / "t").mkdir(parents=True)
    (target / "t" / "stale.bin").write_text("old")
    export_adapters(latest_step_dir(tmp_path / "ckpt"), ["t"], target)
    assert sorted(p.name for p in target.iterdir()) == ["t"]
    assert sorted(p.name for p in (target / "t").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
