"""Each task trained alone with PEFT's own LoRA model, in this process: the reference the joint-training
tests (``tests/executor/torch/test_joint_training.py``, ``test_pipeline_window.py``) hold the executor's
adapters to, and the distance they measure it by."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import peft
import torch
from peft.optimizers import create_loraplus_optimizer
from torch.nn import functional as F

from lorafleet.data.tokenize import IGNORE_INDEX
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers
from lorafleet.executor.torch.optim import build_optimizer, lr_at
from lorafleet.executor.torch.peft_export import lora_config
from lorafleet.executor.torch.quantized_base import dequantized_copy
from lorafleet.executor.torch.worker import TaskTraining
from lorafleet.runtime.data_stream import loss_tokens, task_key
from lorafleet.specs.lora import Quantization
from tests.helpers import fleet_harness as h

STEPS = 4
ATOL = {torch.float32: 1e-5, torch.float64: 1e-9}


def peft_model_of(base: torch.nn.Module, model: torch.nn.Module, task: int, specs: Sequence) -> peft.PeftModel:
    """PEFT's own model of task ``task`` (its :class:`LoraSpec` ``specs[task]``) over a copy of ``base``, every factor
    copied from the joint ``model``: a LoRA or DoRA layer's (``lora_A``/``lora_B`` linears, the magnitude) and a
    VeRA one's vectors (``vera_lambda_d``/``vera_lambda_b`` parameters)."""
    reference = peft.get_peft_model(copy.deepcopy(base), lora_config(specs[task]))
    with torch.no_grad():
        for name, layer in multi_lora_layers(model):
            if task in layer.adapters:
                target = reference.get_submodule(f"base_model.model.{name}")
                for factor, param in layer.factors(task).items():
                    slot = getattr(target, factor)["default"]
                    (slot.weight if isinstance(slot, torch.nn.Module) else slot).copy_(param)
    return reference


def _initial_adapters(
    dtype: torch.dtype = torch.float32, family: str = "llama", tasks: Sequence[TaskTraining] = h.TASKS
) -> torch.nn.Module:
    """The adapters every rank starts from: each task's drawn from its own seed (``task_key``) under the run's."""
    model = h.build_model(family, dtype)
    inject_multi_lora(model, [t.lora for t in tasks], seeds=[task_key(0, t.name) for t in tasks])
    return model


def train_alone(
    task: int,
    dtype: torch.dtype,
    family: str = "llama",
    steps: int = STEPS,
    total_steps: int | None = None,
    tasks: Sequence[TaskTraining] = h.TASKS,
    quantize: Quantization | None = None,
) -> dict[str, torch.Tensor]:
    """Task ``task`` trained by itself with PEFT on its first ``steps`` batches (the rows of its own in every global
    batch: each task's stream is its own), its schedule spanning ``total_steps`` (the task's own by default);
    its adapter by PEFT key. A DoRA adapter starts from PEFT's own magnitude (``||W||_c``), a LoRA+ one trains
    with ``peft.optimizers.create_loraplus_optimizer``'s parameter groups. With ``quantize``, over the quantized base's
    function: every projection's weight its dequantization (what bitsandbytes' quantized linears compute with)."""
    spec = tasks[task]
    base = h.build_model(family, dtype)
    if quantize is not None:
        dequantized_copy(base, quantize)
    model = peft.get_peft_model(base, lora_config(spec.lora))
    with torch.no_grad():  # a VeRA adapter's start is PEFT's own (its projections from the key, lambda_b zero)
        for name, layer in multi_lora_layers(_initial_adapters(dtype, family, tasks)):
            if task in layer.adapters and not spec.lora.use_vera:
                target = model.get_submodule(f"base_model.model.{name}")
                target.lora_A["default"].weight.copy_(layer.lora_A[str(task)])
                target.lora_B["default"].weight.copy_(layer.lora_B[str(task)])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = reference_optimizer(model, spec)
    ratios = [group["lr"] / spec.optimizer.lr for group in optimizer.param_groups]
    streams = h.synthetic_streams()
    for step in range(steps):
        batch = streams.global_batch(step)
        mine = [i for i, t in enumerate(batch.task_ids) if t == task]
        examples = streams.examples(batch.task_ids[mine], batch.sample_ids[mine])
        n_tokens = sum(loss_tokens(e) for e in examples)  # N_t
        # One right-padded batch through HF's own masking (attention_mask), labels -100 on padding.
        width = max(len(e) for e in examples)
        ids = torch.tensor([list(e.input_ids) + [0] * (width - len(e)) for e in examples])
        labels = torch.tensor([list(e.labels) + [IGNORE_INDEX] * (width - len(e)) for e in examples])
        mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in examples])
        logits = model(ids, attention_mask=mask).logits  # (B, S, V)
        ce = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
        (ce / n_tokens).backward()
        if spec.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, spec.optimizer.grad_clip)
        for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
            group["lr"] = lr_at(spec.optimizer, step, total_steps or spec.total_steps) * ratio
        optimizer.step()
        optimizer.zero_grad()
    return {
        k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model, save_embedding_layers=False).items()
    }


def reference_optimizer(model: peft.PeftModel, spec: TaskTraining) -> torch.optim.Optimizer:
    """The task's optimizer over a PEFT model: ``build_optimizer``'s, or under LoRA+ PEFT's own
    ``create_loraplus_optimizer`` (fused Adam(W), as ``build_optimizer`` runs it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.lora.lr_ratio is None:
        return build_optimizer(spec.optimizer, params)
    o = spec.optimizer
    adam = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return create_loraplus_optimizer(
        model, adam, lr=o.lr, loraplus_lr_ratio=spec.lora.lr_ratio, loraplus_weight_decay=o.weight_decay,
        betas=o.betas, fused=True,
    )  # fmt: skip


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
