"""PEFT round trip: export a task, load it with ``PeftModel.from_pretrained``, load it back into a slot."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftModel
from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file, save_file

from lorafleet.errors import InputError
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers, segments_context
from lorafleet.executor.torch.peft_export import load_peft_adapter, save_peft_adapter
from lorafleet.executor.torch.routing import Segments
from lorafleet.specs.lora import LoraSpec

TASKS = [
    LoraSpec(rank=4, alpha=8, dropout=0.1),
    LoraSpec(rank=6, alpha=3.5, target_modules=("k_proj", "v_proj", "up_proj"), use_rslora=True),
]


@pytest.fixture
def trained(tiny_model, randomized):
    """(fresh base, injected model with random adapters, input ids)."""
    base = tiny_model("llama")
    model = copy.deepcopy(base)
    inject_multi_lora(model, TASKS)
    randomized(model)
    ids = torch.randint(0, 1024, (2, 7), generator=torch.Generator().manual_seed(3))
    return base, model, ids


def task_logits(model, ids, task: int) -> torch.Tensor:
    with segments_context(model, Segments.packed([task], [ids.numel()])), torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("task", [0, 1])
def test_peft_loads_the_export_and_gives_the_same_logits(trained, tmp_path, task):
    base, model, ids = trained
    path = save_peft_adapter(model, task, tmp_path / f"task{task}")
    assert sorted(p.name for p in path.iterdir()) == sorted([CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME])
    keys = load_file(path / SAFETENSORS_WEIGHTS_NAME)
    assert "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 2 * len(TASKS[task].target_modules)

    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    want = task_logits(model, ids, task)
    with torch.no_grad():
        got = peft_model(ids).logits
        assert (base(ids).logits - got).abs().max() > 1e-3  # the adapter does something
    assert (got - want).abs().max() <= 1e-5


def test_config_is_deterministic_and_complete(trained, tmp_path):
    _, model, _ = trained
    first = (save_peft_adapter(model, 1, tmp_path / "a") / CONFIG_NAME).read_text()
    second = (save_peft_adapter(model, 1, tmp_path / "b") / CONFIG_NAME).read_text()
    assert first == second
    config = json.loads(first)
    assert list(config) == sorted(config)
    assert config["target_modules"] == ["k_proj", "up_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"], config["use_rslora"], config["peft_type"]) == (6, 3.5, True, "LORA")


def test_load_into_a_slot_reproduces_the_task(trained, tiny_model, tmp_path):
    _, model, ids = trained
    path = save_peft_adapter(model, 1, tmp_path / "task1")
    want = task_logits(model, ids, 1)

    # A fresh model whose slot 0 holds a different adapter (other rank and targets).
    target = tiny_model("llama")
    inject_multi_lora(target, [LoraSpec(rank=2, alpha=2)])
    assert load_peft_adapter(target, path, 0) == TASKS[1].model_copy(
        update={"target_modules": ("k_proj", "up_proj", "v_proj")}
    )
    assert (task_logits(target, ids, 0) - want).abs().max() <= 1e-5
    holders = {name.rsplit(".", 1)[1] for name, layer in multi_lora_layers(target) if 0 in layer.adapters}
    assert holders == {"k_proj", "v_proj", "up_proj"}  # removed where the file has no adapter
    assert all(p.requires_grad for _, layer in multi_lora_layers(target) for p in layer.lora_A.values())


def test_unsupported_or_mismatched_files_are_input_errors(trained, tmp_path):
    _, model, _ = trained
    path = save_peft_adapter(model, 0, tmp_path / "task0")
    config = json.loads((path / CONFIG_NAME).read_text())

    (path / CONFIG_NAME).write_text(json.dumps({**config, "use_dora": True}))  # DoRA, without its magnitudes
    with pytest.raises(InputError, match="lora_magnitude_vector: missing"):
        load_peft_adapter(model, path, 0)

    (path / CONFIG_NAME).write_text(json.dumps(config))
    weights = load_file(path / SAFETENSORS_WEIGHTS_NAME)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    save_file({k: v for k, v in weights.items() if k != key}, path / SAFETENSORS_WEIGHTS_NAME)
    before = [p.clone() for p in model.get_submodule("model.layers.0.mlp.up_proj").lora_A.values()]
    with pytest.raises(InputError, match="up_proj.lora_B.weight: missing"):
        load_peft_adapter(model, path, 0)
    after = list(model.get_submodule("model.layers.0.mlp.up_proj").lora_A.values())
    assert all(torch.equal(b, a) for b, a in zip(before, after))  # nothing changed on error


def test_file_names_are_pefts_own_and_a_worker_starts_without_peft():
    """The names are peft's constants (kept as literals: importing peft costs a worker ~2.5 s at start-up),
    and building a rank's executor imports no peft; only writing or reading an adapter config does."""
    import subprocess
    import sys

    from lorafleet.executor.torch import peft_export

    assert (peft_export.CONFIG_NAME, peft_export.SAFETENSORS_WEIGHTS_NAME) == (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)
    probe = "import sys, lorafleet.train.trainer, lorafleet.executor.torch.launch; print('peft' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
