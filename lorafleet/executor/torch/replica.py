"""``build_replica``: one ordered function from a full base model to this rank's part of a replica.

The order matters and is fixed (torchtitan's ``parallelize_llama`` applies its steps the same
way, one function, comments on why):

1. **inject** every task's adapter into the *whole* model, from one seeded generator. Every
   rank does the same, so every rank starts from the same full adapters whatever its replica
   or shard: the initial state does not depend on the plan.
2. **list the adapter matrices** at their full shapes, and from them and the plan the pieces
   of the gradient sum (``grad_sync``); then **create every process group** (collective,
   idle ranks included, so it must come before anything rank-specific).
3. **TP-shard** the projections and their adapters (``tp``): needs the TP group.
4. **PP-split**: keep this stage's layers (``pipeline``). After TP, so the hooks TP put on the
   attention and MLP blocks travel with the layers that stay.
5. **move** to the device (the whole model was built on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lorafleet.executor.torch.attention import use_document_attention
from lorafleet.executor.torch.grad_sync import (
    FACTORS,
    AdapterParam,
    GradSync,
    adapter_params,
    holder_sets,
    sync_pieces,
)
from lorafleet.executor.torch.groups import build_process_groups
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers
from lorafleet.executor.torch.layout import FleetLayout, ModelDims, RankRole
from lorafleet.executor.torch.multi_lora import LoraBackend
from lorafleet.executor.torch.pipeline import Neighbours, split_for_pipeline
from lorafleet.executor.torch.tp import parallelize_tensor
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.lora import LoraSpec


@dataclass
class Replica:
    """This rank's part of its replica, and what the step needs to run and sync it."""

    model: nn.Module | None
    """The stage (an HF causal LM with only this stage's parts); None on an idle rank."""
    role: RankRole | None
    neighbours: Neighbours | None
    fleet: FleetLayout
    adapter_params: list[AdapterParam]
    """Every adapter matrix at its full shape (the same list on every rank)."""
    params: dict[tuple[int, str, str], nn.Parameter]
    """This rank's local shards, by (task, module, factor)."""
    grad_sync: GradSync

    def task_params(self, task: int) -> list[nn.Parameter]:
        """This rank's shards of one task's adapter (empty when no layer of its stage has it)."""
        return [p for (t, _, _), p in self.params.items() if t == task]


def build_replica(
    model: nn.Module,
    adapters: Sequence[LoraSpec],
    plan: DeploymentPlan,
    rank: int,
    world_size: int,
    *,
    seed: int,
    device: torch.device,
    backend: LoraBackend = LoraBackend.AUTO,
) -> Replica:
    """Turns a full frozen causal LM into this rank's stage, following the steps of the module doc.

    Args:
        model: the full HF causal LM (Llama, Qwen2, Mistral), on the host; changed in place.
        adapters: one LoRA spec per task; adapter id ``i`` is task ``i``.
        plan: the deployment; ``rank``'s replica, stage and TP rank come from it.
        seed: seed of the initial adapter weights (A Kaiming-uniform, B zero, as PEFT).
        device: where this rank computes.
        backend: the multi-LoRA operator's implementation.

    Collective: every rank of the world must call it, with the same plan.
    """
    # 1. Inject, from a generator forked off the global one so building does not move it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_multi_lora(model, adapters, backend=backend)
    use_document_attention(model)  # packed micro-batches attend per sequence (Σ s_i^2, not (Σ s_i)^2)
    for _, layer in multi_lora_layers(model):
        layer.train()  # adapter dropout is on while training; the frozen base stays in eval mode
    # 2. Full shapes, pieces, and every process group.
    fleet = FleetLayout.of(plan, ModelDims.of(model.config), world_size)
    params = adapter_params(model)
    pieces = sync_pieces(fleet, params)
    groups = build_process_groups(fleet, holder_sets(pieces), rank)
    role = fleet.role(rank)
    if role is None:
        return Replica(None, None, None, fleet, params, {}, GradSync(pieces, None, {}, groups.sync))
    # 3. Tensor parallelism, then 4. the pipeline split, then 5. the device.
    parallelize_tensor(model, role.tp_rank, role.replica.tp, groups.tp)
    split_for_pipeline(model, role)
    model.to(device)
    local = {
        (task, name, factor): getattr(layer, factor)[str(task)]
        for name, layer in multi_lora_layers(model)
        for task in sorted(layer.adapters)
        for factor in FACTORS
    }
    dtype = next(model.parameters()).dtype
    neighbours = Neighbours(role.prev_rank, role.next_rank, model.config.hidden_size, dtype, device)
    return Replica(model, role, neighbours, fleet, params, local, GradSync(pieces, role, local, groups.sync))
