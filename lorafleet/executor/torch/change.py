"""A running fleet changed at a step boundary, in its own processes: tasks join and leave, a share or a
deadline changes, or the deployment moves. Nothing restarts: no process, no world, no base model that
stays where it is, no tokenization but the new tasks'.

The coordinator broadcasts a :class:`FleetChange` (the run's tasks from the boundary on, in task order, their
specs and turns, and the deployment); every rank then (:func:`change_fleet`):

1. **data**: keeps every staying task's tokenized examples; only the new tasks' data is prepared, once, on
   rank 0 (the queue's check tokenized it already), and sent to the others (``DataStreams.changed``); the
   turns are those a launch on the task ledger would draw;
2. **which stages stay**: a rank keeps its stage (its base-model shard and the adapters in it) when its
   replica's degrees, its stage and its TP rank are unchanged, its TP group has the same ranks (the TP hooks
   hold that group) and every projection a new task targets in its layers is already wrapped
   (:func:`can_keep_stage`); one all-gather of that flag tells every rank whether some rank builds;
3. **state**: when some rank builds a stage, the staying tasks' whole adapters and optimizer states are
   gathered into rank 0 (as a checkpoint gathers them, ``checkpoint.gather_task_states``) and broadcast;
4. **groups**: every process group is made again over the same world, reusing each group whose purpose and
   ranks it already has (``groups.GroupCache``): a kept deployment creates none, or one for a new holder set;
5. **stages**: a kept stage changes its adapter slots in place (:func:`change_slots`): the adapters of the
   tasks that left are dropped, the others take their new ids (the same parameter objects, so their
   optimizer states stay), and each new task's initial adapter is drawn from its own seed over the whole
   model's projection shapes (``inject.initial_lora_A``, the draw an injection into the whole model makes)
   and sharded as TP shards it. Any other rank builds its stage from the base model's source
   (``replica.build_stage``: per stage from safetensors, as a launch loads it) and restores the staying
   tasks' states into it (``checkpoint.restore_task_states``, as a resume on another plan does); a rank the
   new plan leaves idle drops its stage;
6. **optimizers**: a staying task on a kept stage keeps its optimizer (moments, step count and so its
   learning-rate schedule); a new task gets a fresh one.

Exactness: a task's stream, initial adapter and updates depend on the task alone (``data_stream.task_key``),
the same as across a relaunch, so every task trains as it would alone whatever joins, leaves or moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lorafleet.executor.torch.base_model import SafetensorsWeights
from lorafleet.executor.torch.checkpoint import gather_task_states, restore_task_states
from lorafleet.executor.torch.inject import initial_lora_A, module_suffix, multi_lora_layers, vera_projections
from lorafleet.executor.torch.multi_lora import adapter_dtype
from lorafleet.executor.torch.optim import LORAPLUS_FACTORS, TaskOptimizer
from lorafleet.executor.torch.replica import Replica, assemble_replica, build_stage, fleet_groups
from lorafleet.executor.torch.routing import LoraBackend
from lorafleet.executor.torch.tp import TP_STYLES, adapter_shard_dim, shard
from lorafleet.plans import DeploymentPlan
from lorafleet.runtime.data_stream import DataStreams, TaskData, task_key
from lorafleet.runtime.layout import FleetLayout, RankRole, layer_of
from lorafleet.runtime.processes import fault_point
from lorafleet.specs.lora import LoraSpec, OptimizerSpec
from lorafleet.specs.workload import TaskSpec
from lorafleet.turns import TaskTurns

PHASES = ("data", "state", "groups", "stage", "slots")
"""The phases of a change each rank times (:attr:`ChangeReport.phases`)."""

BaseSource = Callable[[], tuple[nn.Module, SafetensorsWeights | None]]
"""How a rank gets the base model to build a new stage from: ``base_model.load_base`` of the run's source."""


@dataclass(frozen=True, kw_only=True)
class TaskTraining:
    """One task as the executor trains it."""

    name: str
    lora: LoraSpec
    optimizer: OptimizerSpec
    total_steps: int
    """Optimizer steps the schedule spans (the task's ``steps``, or the run's)."""


@dataclass(frozen=True, kw_only=True)
class FleetChange:
    """What the coordinator broadcasts at a boundary: the run from there on."""

    step: int
    """The boundary: the first step run with the change."""
    tasks: tuple[TaskTraining, ...]
    """The run's tasks from ``step`` on, in task order (the staying ones in their order, then the new ones)."""
    specs: tuple[TaskSpec, ...]
    """Their specs (data, batch size, steps, start step, share, deadline), in the same order."""
    plan: DeploymentPlan
    """The deployment from ``step`` on (the running one when it is kept)."""
    turn_changes: Mapping[str, tuple] = field(default_factory=dict)
    """Task -> its share and deadline over time, for the tasks a queued update changed (the ledger's)."""
    departed: tuple[TaskTurns, ...] = ()
    """The turns of every task that has left the run (the ledger's)."""
    stopped: Mapping[str, int] = field(default_factory=dict)
    """Staying tasks stopped for non-finite updates: name -> the first step they take no batch in."""


@dataclass(frozen=True)
class ChangeReport:
    """What a change cost, measured."""

    seconds: float
    """Rank 0's wall time from the command to the changed fleet, every rank done."""
    phases: dict[str, float]
    """Per phase of :data:`PHASES`, the slowest rank's seconds."""
    rebuilt: tuple[int, ...]
    """The ranks that built a new stage (empty when every stage was kept)."""
    groups_created: int
    """Process groups the change created (every rank creates the same ones)."""


@contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] += time.perf_counter() - start


def can_keep_stage(replica: Replica, role: RankRole | None, adapters: Sequence[LoraSpec], new: Sequence[int]) -> bool:
    """Whether this rank's stage can serve ``role`` (None: it will be idle, nothing to build) with the adapter
    slots changed in place (module doc, step 2); ``new``: the tasks whose adapters are to be added."""
    old = replica.role
    if role is None:
        return True
    if old is None or replica.model is None:
        return False
    same = (old.replica.tp, old.replica.pp, old.stage, old.tp_rank) == (
        role.replica.tp,
        role.replica.pp,
        role.stage,
        role.tp_rank,
    )
    moved_tp = old.replica.tp > 1 and old.replica.stage_ranks(old.stage) != role.replica.stage_ranks(role.stage)
    if not same or moved_tp:
        return False
    wrapped = {name for name, _ in multi_lora_layers(replica.model)}
    needed = {
        name
        for name in replica.shapes
        if layer_of(name) in role.layers and any(module_suffix(name) in adapters[t].target_modules for t in new)
    }
    return needed <= wrapped


def change_slots(
    model: nn.Module, role: RankRole, kept: Mapping[int, int], adapters: Sequence[LoraSpec], seeds: Sequence[int],
    shapes: dict[str, tuple[int, int]],
) -> None:  # fmt: skip
    """A kept stage's adapter slots changed in place (module doc, step 5): ``kept`` maps each staying task's new
    id to its old one; every other task of ``adapters`` (new ids) is added, drawn from ``seeds``."""
    renamed = {old: new for new, old in kept.items()}
    added = [t for t in range(len(adapters)) if t not in kept]
    layers = list(multi_lora_layers(model))
    dtype = adapter_dtype(layers[0][1].base_layer.weight.dtype) if layers else torch.float32
    drawn = {t: initial_lora_A(shapes, adapters[t], seeds[t], dtype) for t in added}
    projections = {t: vera_projections(shapes, adapters[t]) for t in added}  # VeRA: over the whole model's shapes
    for name, layer in layers:
        layer.relabel(renamed)
        dim = adapter_shard_dim(TP_STYLES[module_suffix(name)], "lora_A")
        for t in added:
            if projections[t] is not None and module_suffix(name) in adapters[t].target_modules:
                layer.add_adapter(t, adapters[t], projections=projections[t])  # its slice is the layer's own
            elif name in drawn[t]:
                A = shard(drawn[t][name], dim, role.tp_rank, role.replica.tp)
                layer.add_adapter(t, adapters[t], (A, torch.zeros(layer.out_features, adapters[t].rank, dtype=dtype)))


def change_fleet(
    replica: Replica,
    optimizers: Sequence[TaskOptimizer],
    streams: DataStreams,
    tasks: Sequence[TaskTraining],
    change: FleetChange,
    *,
    seed: int,
    device: torch.device,
    backend: LoraBackend,
    base: BaseSource | None,
    task_data: Callable[[TaskSpec], TaskData],
) -> tuple[Replica, list[TaskOptimizer], DataStreams, dict[str, float], bool]:
    """This rank's part of ``change`` (module doc; collective): the fleet was running ``tasks`` on ``replica``
    with ``optimizers`` and ``streams``; ``task_data`` prepares a new task's data (called on rank 0 only);
    ``seed``: the run's (a new adapter's initial weights are drawn from ``task_key(seed, name)``, as at the run's
    start). Returns the new replica, optimizers (in the new task order) and streams, the seconds of each phase,
    and whether this rank kept its stage."""
    phases = dict.fromkeys(PHASES, 0.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    old_names = [t.name for t in tasks]
    names = [t.name for t in change.tasks]
    kept = {new: old_names.index(n) for new, n in enumerate(names) if n in old_names}
    added = [t for t in range(len(names)) if t not in kept]
    loras = [t.lora for t in change.tasks]
    seeds = [task_key(seed, n) for n in names]
    with _timed(phases, "data"):  # tokenized once, on rank 0, and sent: rows are small beside a rank's time
        box = [
            {spec.name: task_data(spec) for spec in change.specs if spec.name not in old_names} if rank == 0 else None
        ]
        dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
        joining = box[0]
        streams = streams.changed(
            change.specs, lambda spec: joining[spec.name], change.turn_changes, change.departed, change.stopped
        )
    fleet = FleetLayout.of(change.plan, replica.dims, world)
    role = fleet.role(rank)
    keep = can_keep_stage(replica, role, loras, added)
    flags: list[bool | None] = [None] * world
    dist.all_gather_object(flags, keep)
    states: list = [None] * len(names)
    if not all(flags):
        with _timed(phases, "state"):
            gathered = gather_task_states(replica, optimizers, [t.lora for t in tasks], old_names)
            box = [gathered]
            dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
            by_name = {state.name: state for state in box[0]}
            states = [by_name[n] if t in kept else None for t, n in enumerate(names)]
    with _timed(phases, "groups"):
        _, params, groups = fleet_groups(change.plan, replica.dims, replica.shapes, loras, rank, world, replica.groups)
    fault_point("slots", change.step, rank)  # the fault matrix's kill of any rank amid a change (processes)
    model = replica.model if keep and role is not None else None
    if model is not None:
        with _timed(phases, "slots"):
            assert role is not None
            change_slots(model, role, kept, loras, seeds, replica.shapes)
    elif role is not None:
        with _timed(phases, "stage"):
            replica.model = None  # the old stage goes before the new one is built
            if base is None:
                raise RuntimeError("a new stage is needed, and the executor was given no base model source")
            whole, weights = base()
            model = build_stage(
                whole, loras, role, groups.tp, seeds=seeds, device=device, backend=backend, weights=weights
            )
    new = assemble_replica(model, fleet, rank, params, groups, replica.shapes, replica.dims, device)
    stays = keep and role is not None and replica.role is not None
    out = []
    for t, task in enumerate(change.tasks):
        if stays and t in kept:
            out.append(optimizers[kept[t]])  # the same parameters: its moments and step count stay
            continue
        fast = new.task_params(t, LORAPLUS_FACTORS)
        out.append(
            TaskOptimizer(task.optimizer, new.task_params(t), task.total_steps, lr_ratio=task.lora.lr_ratio, fast=fast)
        )
        if t in kept:  # every rank steps every task: its count here is the fleet's
            out[t].steps_taken = optimizers[kept[t]].steps_taken
    if model is not None and not stays:  # a new stage: the staying tasks' states as the fleet has them
        with _timed(phases, "state"):
            restore_task_states(new, out, states)
    return new, out, streams, phases, keep
