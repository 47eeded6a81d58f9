"""Which layer calls keep their dropout keep-mask for the backward: those whose micro-batch fits in memory with it.

A call with adapter dropout draws a bool keep-mask ``(T, K)`` (``dropout.py``). Kept for the backward it costs
``T K`` bytes from the forward to the backward; not kept, the backward draws it again from the generator state the
forward drew it from (:class:`~lorafleet.executor.torch.dropout.MaskReplay`), one more draw: on a CPU ~3 % of a step's
CPU time (the Mersenne Twister is serial), on a GPU a Philox kernel at memory bandwidth. So the mask is kept where
the memory model says it fits, and drawn again where memory binds: a layer keeps it in a micro-batch of at most
``MultiLoraLinear.mask_tokens`` rows, the replica's :func:`~lorafleet.costmodel.build.analytic_mask_tokens` (its
analytic memory line with every keep-mask charged, ``costmodel.memory_model``, "Keep-masks"), so the memory model is
right for whichever path a call runs. A pool priced by a measured profile gets 0 (always drawn again): its measured
line has no mask term. Bit for bit the same gradients either way (``tests/executor/torch/test_dropout_replay.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.build import analytic_mask_tokens
from lorafleet.executor.torch.inject import multi_lora_layers
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.gpus import resolve_gpu
from lorafleet.specs.lora import LoraSpec, OptimizerName, Quantization
from lorafleet.specs.model import ModelSpec


def replica_mask_tokens(
    model: ModelSpec | None,
    plan: DeploymentPlan,
    replica_id: int,
    adapters: Sequence[LoraSpec],
    optimizer: OptimizerName | str,
    quantize: Quantization | None = None,
) -> int:
    """The most rows a layer call of replica ``replica_id`` keeps its keep-mask at (module doc): the analytic
    memory line's, with ``adapters`` (optimizer ``optimizer``) over ``model`` stored as ``quantize`` on its pool's
    GPU kind; 0 without a ``model`` (a caller that knows none), or on a pool priced by a measured profile."""
    if model is None:
        return 0
    replica = next(r for r in plan.replicas if r.replica_id == replica_id)
    pool = next(p for p in plan.pools if p.name == replica.pool)
    if pool.cost_model is not None and pool.cost_model.kind == "profile":
        return 0
    load = AdapterLoad.from_specs(adapters, optimizer)
    return analytic_mask_tokens(model, replica.config, load, resolve_gpu(pool.gpu), quantize=quantize)


def keep_masks_up_to(stage: nn.Module | None, tokens: int) -> None:
    """Every multi-LoRA layer of ``stage`` (None: an idle rank) keeps its keep-mask in calls of at most ``tokens``
    rows (``MultiLoraLinear.mask_tokens``)."""
    if stage is None:
        return
    for _, layer in multi_lora_layers(stage):
        layer.mask_tokens = tokens
