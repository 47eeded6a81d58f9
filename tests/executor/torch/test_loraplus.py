"""LoRA+ (``lora.lr_ratio``): B (and a DoRA magnitude) learn at ``lr * ratio``, as PEFT's
``create_loraplus_optimizer`` groups them; a ratio <= 0 is refused. Joint training with LoRA+ tenants on TP and PP
replicas is held to PEFT's LoRA+ optimizer in ``test_dora.py`` (tasks "code" and "chat")."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import yaml
from peft.optimizers import create_loraplus_optimizer
from pydantic import ValidationError

from lorafleet.cli import main
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers
from lorafleet.executor.torch.optim import LORAPLUS_FACTORS, TaskOptimizer
from lorafleet.executor.torch.peft_export import lora_config
from lorafleet.runtime.checkpoint_files import model_card
from lorafleet.specs.lora import LoraSpec, OptimizerSpec
from lorafleet.specs.workload import TaskSpec
from tests.helpers.repo import SMALL_WORKLOAD


@pytest.mark.parametrize("use_dora", [False, True])
def test_a_step_is_pefts_loraplus_step(tiny_model, use_dora):
    """Three AdamW steps of a TaskOptimizer with lr_ratio 16 over an adapter's A, B (and m) move them as PEFT's
    create_loraplus_optimizer does, and B moved far more than A (Adam moves an entry about lr a step)."""
    spec = LoraSpec(rank=4, alpha=8, lr_ratio=16.0, use_dora=use_dora)
    opt = OptimizerSpec(lr=1e-3, weight_decay=0.01, schedule="constant", grad_clip=0.0)
    base = tiny_model("llama")
    ours = copy.deepcopy(base)
    inject_multi_lora(ours, [spec], seeds=[1])
    reference = peft.get_peft_model(copy.deepcopy(base), lora_config(spec))
    layers = list(multi_lora_layers(ours))
    pairs = []  # (ours, PEFT's) per trained tensor
    for name, layer in layers:
        target = reference.get_submodule(f"base_model.model.{name}")
        for factor, param in layer.factors(0).items():
            theirs = getattr(target, factor)["default"].weight
            with torch.no_grad():
                theirs.copy_(param)
            pairs.append((factor, param, theirs))
    fast = [p for f, p, _ in pairs if f in LORAPLUS_FACTORS]
    optimizer = TaskOptimizer(opt, [p for _, p, _ in pairs], 3, lr_ratio=spec.lr_ratio, fast=fast)
    theirs_opt = create_loraplus_optimizer(
        reference, torch.optim.AdamW, lr=opt.lr, loraplus_lr_ratio=spec.lr_ratio, loraplus_weight_decay=0.01,
        fused=True,
    )  # fmt: skip
    start = [p.detach().clone() for _, p, _ in pairs]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for _, p, q in pairs:
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        optimizer.step(grad_norm=0.0)
        theirs_opt.step()
    for (factor, p, q), p0 in zip(pairs, start, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-7)
        moved = float((p.detach() - p0).abs().max())  # Adam moves each entry <= ~lr a step: 3 steps, 3e-3
        assert (moved > 8 * 3e-3) if factor in LORAPLUS_FACTORS else (moved < 1.5 * 3e-3), (factor, moved)
    assert sum(f == "lora_magnitude_vector" for f, _, _ in pairs) == (len(layers) if use_dora else 0)


def test_without_a_ratio_one_group():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    assert len(TaskOptimizer(OptimizerSpec(), [p, q], 1, fast=[q]).optimizer.param_groups) == 1
    assert len(TaskOptimizer(OptimizerSpec(), [p, q], 1, lr_ratio=2.0, fast=[q]).optimizer.param_groups) == 2


@pytest.mark.parametrize("ratio", [0, -1.5])
def test_a_ratio_not_above_zero_is_refused(tmp_path, capsys, ratio):
    with pytest.raises(ValidationError):
        LoraSpec(lr_ratio=ratio)
    raw = json.loads(json.dumps(SMALL_WORKLOAD))
    raw["tasks"][0]["lora"] = {"lr_ratio": ratio}
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tasks[0].lora.lr_ratio" in err, err


def test_the_card_shows_loraplus_and_dora():
    """PEFT's LoraConfig has no LoRA+ field: the adapter's card states the ratio (and DoRA, from the config)."""
    task = TaskSpec.model_validate(
        {"name": "t", "lengths": {"values": [5]}, "batch_size": 1, "context_length": 8, "lora": {"lr_ratio": 16}}
    )
    config = {"base_model_name_or_path": "b", "r": 16, "lora_alpha": 16, "use_dora": True, "target_modules": ["q_proj"]}
    card = model_card("t", config, task, {}, None)
    assert "learning rate 0.0001 (LoRA+: B at 16 x that)" in card and ", DoRA; targets q_proj" in card
    plain = model_card("t", {**config, "use_dora": False}, task.model_copy(update={"lora": LoraSpec()}), {}, None)
    assert "LoRA+" not in plain and "DoRA" not in plain
