"""Tiny random causal LMs (no hub downloads) and a per-task PEFT reference for executor tests."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lorafleet.executor.torch.inject import adapter_parameters, multi_lora_layers
from lorafleet.executor.torch.peft_export import lora_config

# One shape for all three families: GQA (4 query heads share 2 key/value heads).
TINY_SHAPE = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MODEL_KINDS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),  # biased q/k/v projections
    "mistral": (MistralConfig, MistralForCausalLM),
}


def build_tiny_model(kind: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A seeded random tiny causal LM of the given family, fp32, eval mode."""
    config_cls, model_cls = MODEL_KINDS[kind]
    torch.manual_seed(seed)
    return model_cls(config_cls(**TINY_SHAPE)).eval()


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model(kind="llama", seed=0)``."""
    return build_tiny_model


def randomize_adapters(model: torch.nn.Module, seed: int = 1, std: float = 0.2) -> None:
    """Random A and B (B = 0 after init would make every adapter a no-op and tests vacuous)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def peft_reference(base: torch.nn.Module, injected: torch.nn.Module, adapter_id: int) -> peft.PeftModel:
    """PEFT's own model for one task: a copy of ``base`` with that task's weights from ``injected``."""
    layers = [(name, layer) for name, layer in multi_lora_layers(injected) if adapter_id in layer.adapters]
    spec = layers[0][1].adapters[adapter_id]
    reference = peft.get_peft_model(copy.deepcopy(base), lora_config(spec))
    with torch.no_grad():
        for name, layer in layers:
            target = reference.get_submodule(f"base_model.model.{name}")
            target.lora_A["default"].weight.copy_(layer.lora_A[str(adapter_id)])
            target.lora_B["default"].weight.copy_(layer.lora_B[str(adapter_id)])
    return reference


@pytest.fixture
def randomized():
    """``randomized(model, seed=1)``: :func:`randomize_adapters`."""
    return randomize_adapters


@pytest.fixture
def peft_model_for():
    """``peft_model_for(base, injected, adapter_id)``: :func:`peft_reference`."""
    return peft_reference
