"""``build_replica``: one ordered function from a full base model to this rank's part of a replica.

The order matters and is fixed (torchtitan's ``parallelize_llama`` applies its steps the same
way, one function, comments on why):

1. **list the adapter matrices** at their full shapes (from the whole model's projection shapes and
   the adapters' specs: ``grad_sync.adapter_params``), and from them and the plan the pieces of the
   gradient sum (``grad_sync``); then **create every process group** (collective, idle ranks
   included, so it must come before anything rank-specific);
2. **inject** every task's adapter into the *whole* model, each from its own seed. Every rank
   draws the same full adapters whatever its replica or shard: the initial state does not
   depend on the plan.
3. **TP-shard** the projections and their adapters (``tp``): needs the TP group.
4. **PP-split**: keep this stage's layers (``pipeline``). After TP, so the hooks TP put on the
   attention and MLP blocks travel with the layers that stay.
5. **move** to the device (the whole model was built on the host), or, per stage, **load**.

Steps 2-5 are :func:`build_stage`, rank-local: a fleet changed at a step boundary (``change.py``)
runs them again only on the ranks whose stage changes, over groups made (or reused) by step 1.

**Per-stage loading** (``weights`` given, ``base_model.load_base``): the model is a skeleton on
the ``meta`` device, and steps 2-4 run on it unchanged: adapters are created for real on the
host (``inject``), TP and PP cut and drop meta tensors, which costs nothing. Step 5 then reads
from the checkpoint only the base tensors left in the stage, each as the slice TP keeps
(``tp.base_index``, the rule ``parallelize_tensor`` cut the skeleton by), in the model's dtype
on the device; the buffers the checkpoint does not hold (rotary ``inv_freq``) are recomputed
on the host, as ``from_pretrained`` does, and moved. The stage is then the same, name for name
and bit for bit, as the one built from the whole model. Over a quantized base (QLoRA), each projection of the
stage is first read whole, quantized and TP-cut (``quantized_stage``), as the whole-model path would hold it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lorafleet.executor.torch.attention import use_document_attention
from lorafleet.executor.torch.base_model import SafetensorsWeights
from lorafleet.executor.torch.fused import output_parts
from lorafleet.executor.torch.grad_sync import (
    AdapterParam,
    GradSync,
    Piece,
    adapter_params,
    holder_sets,
    sync_pieces,
)
from lorafleet.executor.torch.groups import GroupCache, ProcessGroups, build_process_groups
from lorafleet.executor.torch.inject import inject_multi_lora, module_suffix, multi_lora_layers, projection_shapes
from lorafleet.executor.torch.pipeline import Neighbours, split_for_pipeline
from lorafleet.executor.torch.quantized_stage import QuantizedWeights, load_quantized_projections
from lorafleet.executor.torch.routing import LoraBackend
from lorafleet.executor.torch.tp import base_index, parallelize_tensor
from lorafleet.plans import DeploymentPlan
from lorafleet.runtime.layout import FleetLayout, ModelDims, RankRole
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
    update_group: dist.ProcessGroup | None
    """Every rank: the per-task updates' statistics (``updates``); None in a world of one."""
    shapes: dict[str, tuple[int, int]]
    """Every projection of the whole model an adapter may target (``inject.projection_shapes``): what the
    adapter matrices and a new task's initial adapter are derived from once the model is split."""
    dims: ModelDims
    groups: GroupCache
    """Every process group this rank has made: a change of the fleet (``change.py``) reuses them."""

    def task_params(self, task: int, factors: Collection[str] | None = None) -> list[nn.Parameter]:
        """This rank's shards of one task's adapter (empty when no layer of its stage has it); only ``factors``'
        (``lora_B``, ...) when given."""
        return [p for (t, _, f), p in self.params.items() if t == task and (factors is None or f in factors)]


def build_replica(
    model: nn.Module,
    adapters: Sequence[LoraSpec],
    plan: DeploymentPlan,
    rank: int,
    world_size: int,
    *,
    seeds: Sequence[int],
    device: torch.device,
    backend: LoraBackend = LoraBackend.AUTO,
    weights: SafetensorsWeights | None = None,
) -> Replica:
    """Turns a full frozen causal LM into this rank's stage, following the steps of the module doc.

    Args:
        model: the full HF causal LM (Llama, Qwen2, Mistral), on the host, or with ``weights``
            its skeleton on the meta device; changed in place.
        adapters: one LoRA spec per task; adapter id ``i`` is task ``i``.
        plan: the deployment; ``rank``'s replica, stage and TP rank come from it.
        seeds: per adapter, the seed of its initial weights (A Kaiming-uniform, B zero, as PEFT).
        device: where this rank computes.
        backend: the multi-LoRA operator's implementation.
        weights: per-stage loading: where the skeleton's base tensors are read from.

    Collective: every rank of the world must call it, with the same plan.
    """
    # 2. Full shapes, pieces, and every process group (before anything rank-specific: collective).
    shapes, dims = projection_shapes(model), ModelDims.of(model.config)
    fleet, params, groups = fleet_groups(plan, dims, shapes, adapters, rank, world_size, GroupCache())
    role = fleet.role(rank)
    # 1, 3-5. Inject, shard, split, move or load (this rank's stage only).
    stage = build_stage(model, adapters, role, groups.tp, seeds=seeds, device=device, backend=backend, weights=weights)
    return assemble_replica(stage, fleet, rank, params, groups, shapes, dims, device)


def fleet_groups(
    plan: DeploymentPlan,
    dims: ModelDims,
    shapes: dict[str, tuple[int, int]],
    adapters: Sequence[LoraSpec],
    rank: int,
    world_size: int,
    cache: GroupCache,
) -> tuple[FleetLayout, list[AdapterParam], FleetGroups]:
    """The plan's layout, every adapter matrix, and the process groups (made, or reused from ``cache``; collective)."""
    fleet = FleetLayout.of(plan, dims, world_size)
    params = adapter_params(shapes, adapters, dims)
    pieces = sync_pieces(fleet, params)
    return fleet, params, FleetGroups(pieces, build_process_groups(fleet, holder_sets(pieces), rank, cache), cache)


@dataclass(frozen=True)
class FleetGroups:
    """The gradient-sum pieces of a fleet and this rank's groups in it, as :func:`assemble_replica` takes them."""

    pieces: tuple[Piece, ...]
    made: ProcessGroups
    cache: GroupCache

    @property
    def tp(self) -> dist.ProcessGroup | None:
        return self.made.tp


def build_stage(
    model: nn.Module,
    adapters: Sequence[LoraSpec],
    role: RankRole | None,
    tp_group: dist.ProcessGroup | None,
    *,
    seeds: Sequence[int],
    device: torch.device,
    backend: LoraBackend,
    weights: SafetensorsWeights | None,
) -> nn.Module | None:
    """Steps 1 and 3-5 on this rank: ``role``'s stage of the whole ``model`` (None for an idle rank)."""
    if role is None:
        return None
    # 1. Inject, each adapter from its own seed (the global generator does not move).
    inject_multi_lora(model, adapters, backend=backend, seeds=seeds)
    use_document_attention(model)  # packed micro-batches attend per sequence (Σ s_i^2, not (Σ s_i)^2)
    for _, layer in multi_lora_layers(model):
        layer.train()  # adapter dropout is on while training; the frozen base stays in eval mode
    # 3. Tensor parallelism, then 4. the pipeline split, then 5. the device.
    parallelize_tensor(model, role.tp_rank, role.replica.tp, tp_group)
    split_for_pipeline(model, role)
    if isinstance(weights, QuantizedWeights):  # a quantized base's projections: read whole, quantized, TP-cut
        load_quantized_projections(model, weights, role, device)
    if weights is not None:
        load_stage(model, weights, role, device)
    model = model.to(device)  # per stage: moves the adapters, the rest is there
    for _, layer in multi_lora_layers(model):  # DoRA magnitudes added over a skeleton: ||W||_c of the loaded W
        layer.init_magnitudes()
    return model  # per stage: moves the adapters, the rest is there


def assemble_replica(
    model: nn.Module | None,
    fleet: FleetLayout,
    rank: int,
    params: list[AdapterParam],
    groups: FleetGroups,
    shapes: dict[str, tuple[int, int]],
    dims: ModelDims,
    device: torch.device,
) -> Replica:
    """The :class:`Replica` of ``rank``'s built stage (None: an idle rank) in ``fleet``: its local adapter shards by
    key, its pipeline neighbours and its side of the gradient sum."""
    role = fleet.role(rank)
    if model is None or role is None:
        sync = GradSync(groups.pieces, None, {}, groups.made.sync)
        return Replica(None, None, None, fleet, params, {}, sync, groups.made.updates, shapes, dims, groups.cache)
    local = {
        (task, name, factor): param
        for name, layer in multi_lora_layers(model)
        for task in sorted(layer.adapters)
        for factor, param in layer.factors(task).items()
    }
    dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)  # the base's: adapters may be fp32 masters
    neighbours = Neighbours(role.prev_rank, role.next_rank, model.config.hidden_size, dtype, device)
    sync = GradSync(groups.pieces, role, local, groups.made.sync)
    return Replica(model, role, neighbours, fleet, params, local, sync, groups.made.updates, shapes, dims, groups.cache)


def load_stage(model: nn.Module, weights: SafetensorsWeights, role: RankRole, device: torch.device) -> None:
    """Replaces every meta tensor of a skeleton's stage by its real value (step 5, per stage).

    A parameter or persistent buffer is read from ``weights`` under its name *before*
    injection (an injected projection keeps its linear as ``base_layer``: the stage's
    ``...q_proj.base_layer.weight`` is the checkpoint's ``...q_proj.weight``), as the slice
    ``tp.base_index`` gives for this TP rank. Tied tensors are read once and stay tied.
    """
    before_injection = {id(layer.base_layer): name for name, layer in multi_lora_layers(model)}
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    real: dict[int, Tensor] = {}  # meta tensor -> its value, so a tied pair stays one tensor
    recompute: list[nn.Module] = []
    for module_name, module in model.named_modules():
        name = before_injection.get(id(module), module_name)
        tensors = [(k, t, module._parameters) for k, t in module._parameters.items()]
        tensors += [(k, t, module._buffers) for k, t in module._buffers.items()]
        for key, meta, slot in tensors:
            if meta is None or not meta.is_meta:
                continue
            if key in module._non_persistent_buffers_set and slot is module._buffers:
                recompute.append(module)
                continue
            if id(meta) not in real:
                full = f"{name}.{key}"
                shape = weights.entries[full].shape
                parts = output_parts(module_suffix(name), shape[0], heads, kv_heads) if shape else ()  # fused rows
                pieces = [
                    weights.read(full, index, meta.dtype, device)
                    for index in base_index(name, key, shape, role.tp_rank, role.replica.tp, parts)
                ]
                value = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                if value.shape != meta.shape:
                    raise RuntimeError(f"{full}: read {tuple(value.shape)}, the stage holds {tuple(meta.shape)}")
                real[id(meta)] = nn.Parameter(value, requires_grad=False) if slot is module._parameters else value
            slot[key] = real[id(meta)]
    for module in dict.fromkeys(recompute):
        _recompute_buffers(model, module)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"per-stage loading left meta tensors: {left}")


def _recompute_buffers(model: nn.Module, module: nn.Module) -> None:
    """Recomputes a module's non-persistent buffers (rotary ``inv_freq``, Gemma's embedding scale) on the host, as
    ``from_pretrained`` does: a placeholder, then transformers' own ``_init_weights`` of the module. NaN placeholders
    show any value it did not write. A module's parameters (Gemma's embedding matrix, loaded already) are kept:
    ``_init_weights`` draws over stand-ins, and the loaded ones are put back."""
    loaded = dict(module._parameters)
    for key, param in loaded.items():
        if param is not None:
            module._parameters[key] = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=False)
    for key in module._non_persistent_buffers_set:
        if module._buffers.get(key) is not None:
            module._buffers[key] = torch.full_like(module._buffers[key], float("nan"), device="cpu")
    model._init_weights(module)
    module._parameters.update(loaded)
    for key in module._non_persistent_buffers_set:
        if module._buffers.get(key) is not None and module._buffers[key].isnan().any():
            raise RuntimeError(f"{type(module).__name__}.{key}: not recomputed by {type(model).__name__}._init_weights")
