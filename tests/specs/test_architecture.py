"""Which model families lorafleet trains, and how a LoRA target list maps onto each one's projections."""

from __future__ import annotations

import json

import pytest

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.errors import InputError
from lorafleet.specs.architecture import model_targets
from lorafleet.specs.lora import LLAMA_TARGET_MODULES, LoraSpec
from lorafleet.specs.model import MODEL_PRESETS, resolve_model


def test_phi3_fuses_the_llama_names_and_refuses_a_part():
    assert model_targets(LLAMA_TARGET_MODULES, "phi3") == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert model_targets(("v_proj", "q_proj", "k_proj"), "phi3") == ("qkv_proj",)
    assert model_targets(("qkv_proj", "down_proj"), "phi3") == ("qkv_proj", "down_proj")
    with pytest.raises(ValueError, match="fuses q_proj, k_proj, v_proj into qkv_proj.*missing k_proj"):
        model_targets(("q_proj", "v_proj"), "phi3")
    with pytest.raises(ValueError, match="llama has no gate_up_proj"):
        model_targets(("gate_up_proj",), "llama")
    assert model_targets(("q_proj", "v_proj"), "gemma2") == ("q_proj", "v_proj")


def test_cost_model_prices_one_adapter_on_a_fused_projection():
    """A Phi-3 adapter on q, k, v is one A (r, h) and one B (q + 2 kv, r): 2 r h fewer parameters than three."""
    phi3 = MODEL_PRESETS["phi3-mini"]
    llama_like = phi3.model_copy(update={"model_type": "llama"})
    fused = AdapterLoad.from_specs([LoraSpec(rank=8, target_modules=("qkv_proj",))])
    assert fused.tasks[0].targets == ("q_proj", "k_proj", "v_proj")
    three = AdapterLoad.from_specs([LoraSpec(rank=8, target_modules=("q_proj", "k_proj", "v_proj"))])
    assert three.params_per_layer(llama_like) - fused.params_per_layer(phi3) == 2 * 8 * phi3.hidden


@pytest.mark.parametrize(
    "model_type,message",
    [
        ("phi", "not supported \\(Phi-1/2; phi3"),
        ("gemma3", "multimodal Gemma 3"),
        ("gpt2", "'gpt2' is not supported \\(supported: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3\\)"),
    ],
)
def test_an_unsupported_model_type_is_one_line_naming_the_file(tmp_path, model_type, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    with pytest.raises(InputError, match=message) as err:
        resolve_model(str(tmp_path), "w.yaml", "model")
    assert err.value.path == str(tmp_path / "config.json") and err.value.field == "model_type"


def test_a_hub_id_not_on_disk_says_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="`hf download Qwen/Qwen3-8B --local-dir Qwen3-8B`") as err:
        resolve_model("Qwen/Qwen3-8B", "w.yaml", "model")
    assert (err.value.path, err.value.field) == ("w.yaml", "model") and "\n" not in str(err.value)
