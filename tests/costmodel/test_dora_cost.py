"""DoRA's terms in the analytic time model (``costmodel.dora_cost``) and its factor against PEFT PR #1474's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.analytic import analytic_dora_factor, analytic_layer_time
from lorafleet.costmodel.dora_cost import dora_terms
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.specs.gpus import resolve_gpu
from lorafleet.specs.lora import LoraSpec
from lorafleet.specs.model import MODEL_PRESETS

LLAMA7B, A100 = MODEL_PRESETS["llama2-7b"], resolve_gpu("a100-40gb")
SHAPE = MicroBatchShape.padded(4, 1024)


def test_the_factor_with_dropout_is_in_pefts_measured_range():
    """PEFT PR #1474: DoRA 1.6-2.1x LoRA's step (its DoRA ran the second base GEMM, as ours does under dropout).
    Without dropout the base output is reused: only the norm and the rescale are left."""
    load = AdapterLoad.uniform(6)
    with_dropout = analytic_dora_factor(LLAMA7B, A100, load, SHAPE, dropout=True)
    without = analytic_dora_factor(LLAMA7B, A100, load, SHAPE, dropout=False)
    assert 1.6 <= with_dropout <= 2.1, with_dropout
    assert 1.0 < without < 1.3 and without < with_dropout, without
    assert with_dropout == pytest.approx(2.03, abs=0.01) and without == pytest.approx(1.24, abs=0.01)  # the doc's


def test_no_dora_task_adds_nothing_and_a_share_adds_in_proportion():
    plain = AdapterLoad.from_specs([LoraSpec(rank=16), LoraSpec(rank=16)])
    assert dora_terms(LLAMA7B, plain, 1, 1e14, 1e12, 2) == (0.0, 0.0)
    one = AdapterLoad.from_specs([LoraSpec(rank=16, use_dora=True, dropout=0.1), LoraSpec(rank=16)])
    both = AdapterLoad(tuple(replace(one.tasks[0]) for _ in range(2)))
    assert one.tasks[0].dora and one.tasks[0].dora_dropout and not one.tasks[1].dora
    assert one.dora_share() == 0.5 and both.dora_share(with_dropout=True) == 1.0
    half, full = dora_terms(LLAMA7B, one, 2, 1e14, 1e12, 2), dora_terms(LLAMA7B, both, 2, 1e14, 1e12, 2)
    assert half == pytest.approx((full[0] / 2, full[1] / 2))
    c_plain = analytic_layer_time(LLAMA7B, A100, 2, plain).c
    c_dora = analytic_layer_time(LLAMA7B, A100, 2, one).c
    assert c_dora[2] > c_plain[2] and c_dora[5] > c_plain[5] and c_dora[0] == c_plain[0]


def test_dora_without_dropout_costs_no_gemm():
    no_dropout = AdapterLoad.from_specs([LoraSpec(rank=16, use_dora=True)])
    assert not no_dropout.tasks[0].dora_dropout
    per_token, _ = dora_terms(LLAMA7B, no_dropout, 1, 1e30, 1e12, 2)  # GEMMs free: only the rescale's bytes remain
    per_token_dropout, _ = dora_terms(LLAMA7B, AdapterLoad.from_specs([LoraSpec(use_dora=True, dropout=0.1)]), 1,
                                      1e30, 1e12, 2)  # fmt: skip
    assert per_token == pytest.approx(per_token_dropout) and per_token > 0
