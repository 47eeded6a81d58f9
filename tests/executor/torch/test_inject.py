"""Injection into tiny Llama / Qwen2 / Mistral (GQA): a mixed batch equals PEFT run task by task."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lorafleet.executor.torch.inject import (
    adapter_parameters,
    inject_multi_lora,
    multi_lora_layers,
    segments_context,
)
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.routing import Segments
from lorafleet.specs.lora import LoraSpec

TASKS = [
    LoraSpec(rank=4, alpha=8),
    LoraSpec(rank=8, alpha=4, target_modules=("q_proj", "v_proj"), use_rslora=True),
    LoraSpec(rank=2, alpha=16, target_modules=("o_proj", "gate_proj", "down_proj")),
]
SEQ_LEN = 8
# A right-padded batch: sequence b belongs to task SEQ_TASKS[b] and has SEQ_LENGTHS[b] tokens.
SEQ_TASKS = [0, 1, 2, 0, 1]
SEQ_LENGTHS = [8, 5, 7, 3, 6]


def padded_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1024, (len(SEQ_TASKS), SEQ_LEN), generator=gen)
    mask = (torch.arange(SEQ_LEN)[None, :] < torch.tensor(SEQ_LENGTHS)[:, None]).long()
    return ids, mask


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_mixed_batch_equals_peft_per_task(kind, tiny_model, randomized, peft_model_for):
    base = tiny_model(kind)
    model = copy.deepcopy(base)
    injected = inject_multi_lora(model, TASKS)
    randomized(model)
    ids, mask = padded_batch()
    weights = torch.randn(len(SEQ_TASKS), SEQ_LEN, 1024, generator=torch.Generator().manual_seed(5))
    valid = mask.bool()

    # Sanity check: each task's PEFT model gives its own logits, all different from the base.
    references = [peft_model_for(base, model, t) for t in range(len(TASKS))]
    base_logits = base(ids, attention_mask=mask).logits
    ref_logits = [ref(ids, attention_mask=mask).logits.detach() for ref in references]
    for t, logits in enumerate(ref_logits):
        assert (logits - base_logits).abs()[valid].max() > 1e-3
        for other in ref_logits[t + 1 :]:
            assert (logits - other).abs()[valid].max() > 1e-3

    segments = Segments.padded(SEQ_TASKS, SEQ_LENGTHS, seq_len=SEQ_LEN)
    with segments_context(model, segments):
        logits = model(ids, attention_mask=mask).logits
    (logits * weights * mask[..., None]).sum().backward()

    for t, ref in enumerate(references):
        rows = [b for b, task in enumerate(SEQ_TASKS) if task == t]
        want = ref(ids[rows], attention_mask=mask[rows]).logits
        (want * weights[rows] * mask[rows, :, None]).sum().backward()
        got = logits[rows]
        torch.testing.assert_close(got[valid[rows]], want[valid[rows]], rtol=1e-5, atol=1e-5)
        n_checked = 0
        for name, layer in injected_layers(model, injected):
            if t not in layer.adapters:
                assert not hasattr(ref.get_submodule(f"base_model.model.{name}"), "lora_A")
                continue
            peft_layer = ref.get_submodule(f"base_model.model.{name}")
            for ours, theirs in ((layer.lora_A, peft_layer.lora_A), (layer.lora_B, peft_layer.lora_B)):
                assert_close_to_scale(ours[str(t)].grad, theirs["default"].weight.grad)
            n_checked += 1
        assert n_checked == 2 * len(TASKS[t].target_modules)  # every target in both decoder layers


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-5) -> None:
    """Max abs error within ``rel`` of the tensor's max abs: these gradients are O(10-100), and
    summing a different batch composition reorders fp32 sums (errors ~1e-6 relative)."""
    assert (got - want).abs().max() <= rel * want.abs().max()


def injected_layers(model, names):
    return [(name, model.get_submodule(name)) for name in names]


def test_injection_wraps_targets_and_freezes_the_rest(tiny_model):
    model = tiny_model("llama")
    names = inject_multi_lora(model, TASKS)
    assert len(names) == 2 * 7  # every projection of both layers is targeted by some task
    layer = model.get_submodule("model.layers.1.self_attn.k_proj")
    assert isinstance(layer, MultiLoraLinear) and isinstance(layer.base_layer, nn.Linear)
    assert layer.out_features == 32  # GQA: 2 kv heads x head_dim 16
    assert list(layer.adapters) == [0]  # tasks 1 and 2 do not target k_proj
    assert not layer.training  # the eval model stays in eval mode
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in adapter_parameters(model)}
    assert len(list(adapter_parameters(model, 1))) == 2 * 2 * 2  # (A, B) x (q, v) x 2 layers
    with pytest.raises(TypeError, match="wraps nn.Linear"):
        inject_multi_lora(model, TASKS)  # already injected


def test_segments_context_sets_and_restores(tiny_model):
    model = tiny_model("llama")
    inject_multi_lora(model, TASKS[:1])
    outer, inner = Segments.packed([0], [4]), Segments.packed([0], [2])
    with segments_context(model, outer):
        with segments_context(model, inner):
            assert all(layer.segments is inner for _, layer in multi_lora_layers(model))
        assert all(layer.segments is outer for _, layer in multi_lora_layers(model))
    assert all(layer.segments is None for _, layer in multi_lora_layers(model))


def test_no_matching_module_is_an_error():
    with pytest.raises(ValueError, match="matches target_modules"):
        inject_multi_lora(nn.Sequential(nn.Linear(4, 4)), TASKS)
