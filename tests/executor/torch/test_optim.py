"""Per-task learning-rate schedules, clipping and optimizer steps."""

from __future__ import annotations

import math

import pytest
import torch

from lorafleet.executor.torch.optim import TaskOptimizer, clip_coefficient, lr_at
from lorafleet.specs.lora import OptimizerSpec
from tests.helpers.op_count import OpCount


def test_warmup_then_cosine_to_the_floor():
    spec = OptimizerSpec(lr=1.0, warmup_steps=3, schedule="cosine", min_lr_ratio=0.1)
    lrs = [lr_at(spec, s, total_steps=10) for s in range(10)]
    assert lrs[:3] == pytest.approx([0.25, 0.5, 0.75])
    assert lrs[3] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize("schedule,last", [("linear", 0.0), ("constant", 1.0)])
def test_linear_and_constant(schedule, last):
    spec = OptimizerSpec(lr=1.0, schedule=schedule)
    assert lr_at(spec, 0, 5) == 1.0 and lr_at(spec, 4, 5) == pytest.approx(last)
    assert lr_at(spec, 7, 5) == pytest.approx(last)  # past the end: stays at the floor


def test_clip_coefficient_matches_torch():
    grads = [torch.randn(4, 5, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    norm = float(torch.cat([g.flatten() for g in grads]).norm())
    params = [torch.nn.Parameter(torch.zeros(4, 5)) for _ in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    assert torch.allclose(params[0].grad, grads[0] * clip_coefficient(0.5, norm))
    assert clip_coefficient(100.0, norm) == 1.0 and clip_coefficient(0.0, norm) == 1.0


def test_a_zero_gradient_still_steps_adamw():
    """A rank that saw none of a task's sequences steps with a zero gradient, like the reference."""
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = TaskOptimizer(OptimizerSpec(lr=0.1, weight_decay=0.5, schedule="constant"), [p], total_steps=2)
    assert optimizer.step(grad_norm=0.0) == 0.1
    assert torch.allclose(p.detach(), torch.full((3,), 1 - 0.1 * 0.5)) and p.grad is None
    assert optimizer.steps_taken == 1


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_a_task_step_is_torchs_per_tensor_step(name, dtype, tol):
    """A task's fused (Adam, AdamW) or foreach (SGD) step, clipping included, gives torch's per-tensor
    loop's weights to rounding over several steps, and the same bits when run again."""
    spec = OptimizerSpec(name=name, lr=0.05, weight_decay=0.1, warmup_steps=1, grad_clip=0.5)
    shapes = [(4, 6), (6, 4), (8, 6), (6, 8)]

    def grads(step: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        return [torch.randn(s, dtype=dtype, generator=gen) for s in shapes]

    def ours() -> list[torch.Tensor]:
        params = [torch.nn.Parameter(torch.ones(s, dtype=dtype)) for s in shapes]
        optimizer = TaskOptimizer(spec, params, total_steps=4)
        for step in range(4):
            for p, g in zip(params, grads(step), strict=True):
                p.grad = g
            optimizer.step(float(torch.cat([g.flatten() for g in grads(step)]).norm()))
        return [p.detach() for p in params]

    params = [torch.nn.Parameter(torch.ones(s, dtype=dtype)) for s in shapes]
    kind = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    reference = kind(params, lr=spec.lr, weight_decay=spec.weight_decay, foreach=False)
    for step in range(4):
        for p, g in zip(params, grads(step), strict=True):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip, foreach=False)
        for group in reference.param_groups:
            group["lr"] = lr_at(spec, step, 4)
        reference.step()
    got = ours()
    assert all((a - b).abs().max() <= tol for a, b in zip(got, params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got, ours(), strict=True))


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_a_task_step_runs_the_same_ops_for_any_number_of_matrices(name):
    """A task's adapter is hundreds of small matrices: its step, clipping included, is a fixed number of
    multi-tensor ops (fused Adam/AdamW, foreach SGD) once its state exists, not a per-tensor loop whose
    ops grow with the count (torch's CPU default: ~10 ops a matrix, 115 ms a step per demo task; #27)."""
    spec = OptimizerSpec(name=name, lr=0.05, weight_decay=0.1, grad_clip=0.5)

    def ops_of_a_step(n_matrices: int) -> int:
        params = [torch.nn.Parameter(torch.ones(4, 6)) for _ in range(n_matrices)]
        optimizer = TaskOptimizer(spec, params, total_steps=4)
        for _ in range(2):  # the first step creates the moments, a tensor each, once
            for p in params:
                p.grad = torch.full((4, 6), 2.0)
            with OpCount() as counted:
                optimizer.step(grad_norm=10.0)  # clipped: the gradients are scaled first
        return sum(counted.ops.values())

    assert ops_of_a_step(40) == ops_of_a_step(4)
