"""Which calls keep their dropout keep-mask (``mask_memory.py``): up to the rows the replica's analytic memory line
fits with every keep-mask charged; none on a profiled pool, or without the model's shape."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.build import analytic_mask_tokens
from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.executor.torch.inject import multi_lora_layers
from lorafleet.executor.torch.mask_memory import keep_masks_up_to, replica_mask_tokens
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.worker import ExecutorConfig, TorchExecutor
from lorafleet.specs.gpus import GPU_PRESETS
from lorafleet.specs.lora import LoraSpec, OptimizerName, Quantization
from lorafleet.specs.model import MODEL_PRESETS
from tests.helpers.fleet_harness import TASKS, Run, build_model, plan_of, run_world, synthetic_streams

LLAMA7B = MODEL_PRESETS["llama2-7b"]
LORAS = (LoraSpec(rank=16, alpha=32, dropout=0.05), LoraSpec(rank=8, alpha=16))


def test_a_replica_keeps_masks_up_to_its_analytic_mask_tokens():
    """Each replica gets its own config's analytic figure, on its pool's GPU kind, below the M its line gives (the
    masks take room) and above 0; a quantized base leaves more room."""
    plan = plan_of((1, 1), (2, 1), (2, 2), gpu="A100-80GB")
    load = AdapterLoad.from_specs(LORAS, OptimizerName.ADAMW)
    assert [t.dropout for t in load.tasks] == [True, False]
    gpu = GPU_PRESETS["A100-80GB"]
    got = [replica_mask_tokens(LLAMA7B, plan, r, LORAS, "adamw") for r in range(3)]
    layouts = (ParallelConfig(1, 1), ParallelConfig(2, 1), ParallelConfig(2, 2))
    assert got == [analytic_mask_tokens(LLAMA7B, c, load, gpu) for c in layouts]
    assert all(t > 0 for t in got) and got[0] < got[1]
    assert replica_mask_tokens(LLAMA7B, plan, 0, LORAS, "adamw", quantize=Quantization.NF4) > got[0]


def test_no_mask_is_kept_on_a_profiled_pool_or_without_the_models_shape():
    profiled = CostModelOrigin(kind="profile", gpu="A100-80GB", profile="a100.json", sha256="ab")
    assert replica_mask_tokens(LLAMA7B, plan_of((1, 1), gpu="A100-80GB", cost_model=profiled), 0, LORAS, "adamw") == 0
    assert replica_mask_tokens(None, plan_of((1, 1), gpu="A100-80GB"), 0, LORAS, "adamw") == 0


def test_every_layer_of_a_stage_gets_the_rows():
    stage = nn.Sequential(MultiLoraLinear(nn.Linear(8, 4)), nn.ReLU(), MultiLoraLinear(nn.Linear(4, 8)))
    assert [m.mask_tokens for m in stage if isinstance(m, MultiLoraLinear)] == [0, 0]
    keep_masks_up_to(stage, 1234)
    assert [m.mask_tokens for m in stage if isinstance(m, MultiLoraLinear)] == [1234, 1234]
    keep_masks_up_to(None, 5)  # an idle rank: nothing to set


def _layers_mask_tokens(run: Run) -> list[int]:
    """Every rank's body: the distinct ``mask_tokens`` of its stage's layers once its executor is built."""
    tiny = MODEL_PRESETS["tiny-llama"]
    config = ExecutorConfig(plan=run.plan, tasks=run.tasks, base_model="tiny-llama", model_spec=tiny)
    executor = TorchExecutor(config, build_model(), synthetic_streams(), torch.device("cpu"))
    tokens = sorted({layer.mask_tokens for _, layer in multi_lora_layers(executor.replica.model)})
    executor.close()
    return tokens


def test_an_executor_sets_its_replicas_mask_tokens_on_every_layer(tmp_path):
    """A TorchExecutor given the model's shape sets its replica's figure on every layer of its stage."""
    tasks = tuple(replace(t, lora=t.lora.model_copy(update={"dropout": 0.1})) for t in TASKS)
    plan = plan_of((1, 1))
    [got] = run_world(1, [Run(plan, steps=0, tasks=tasks)], tmp_path, body=_layers_mask_tokens)
    want = replica_mask_tokens(MODEL_PRESETS["tiny-llama"], plan, 0, [t.lora for t in tasks], "adamw")
    assert got == [want] and want > 0
