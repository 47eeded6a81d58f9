"""Adapters that travel (#42): ``base_model_name_or_path`` of a local base resolves from any directory, so the
model card's own ``AutoPeftModelForCausalLM`` snippet works there; the card says when the weights trained over
were not the named base's own (a GGUF file's dequantized weights, random weights); and it names the data file
without the training machine's directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lorafleet.data.model_source import base_weights_note
from lorafleet.runtime.checkpoint_files import model_card
from lorafleet.specs.model import adapter_base_model
from lorafleet.specs.workload import TaskSpec


def test_the_cards_snippet_loads_a_local_base_from_another_directory(tmp_path, monkeypatch):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    (tmp_path / "work").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # where the run started: the workload says model: base
    LlamaForCausalLM(config).save_pretrained("base")
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained("base"), LoraConfig(r=2, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    written = adapter_base_model("base")
    assert written == str(tmp_path / "work" / "base")
    monkeypatch.chdir(tmp_path / "elsewhere")
    # The relative name lorafleet wrote before #42 names nothing here (PEFT would take it for a Hub id).
    assert not Path("base").exists()
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "base_model_name_or_path": written}))
    model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    assert model.peft_config["default"].base_model_name_or_path == written
    assert isinstance(model.base_model.model, LlamaForCausalLM)


def test_the_card_says_what_weights_the_adapter_learnt_over(tmp_path):
    gguf = base_weights_note("smollm2-135m")
    assert gguf is not None and "`SmolLM2-135M-Instruct.Q4_1.gguf`, dequantized to full precision" in gguf
    assert "seeded random weights of the `tiny-llama` preset" in (base_weights_note("tiny-llama") or "")
    (tmp_path / "config.json").write_text("{}")
    assert base_weights_note(str(tmp_path)) is None  # an HF directory's weights are the named base's own
    config = {"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "r": 8}
    card = model_card("chat", config, None, {}, None, base_weights=gguf)
    assert f"- Base weights: {gguf}" in card.splitlines()


def test_the_card_names_the_data_file_not_its_directories(tmp_path):
    data = tmp_path / "private" / "home" / "chat.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    task = TaskSpec(name="chat", data={"path": str(data)}, batch_size=1, context_length=8)
    manifest = {"data": {"tasks": ["chat"], "examples": [2], "cursors": [5]}}  # 5 rows drawn: 2.5 epochs
    card = model_card("chat", {"base_model_name_or_path": "b"}, task, manifest, None)
    assert "- Data: `chat.jsonl` (2 rows; 2 to train on, 2 seen (2.5 epochs)), format text (auto)" in card.splitlines()
    assert "private" not in card
