"""Checkpoints that do not depend on the plan, committed atomically, resumed exactly.

**What is saved** (per task, whole matrices, whatever the replicas' TP/PP split):

    <dir>/step-000004/manifest.json              step, data cursors, optimizer steps, caller state
    <dir>/step-000004/<task>/adapter_config.json  a PEFT adapter (PeftModel.from_pretrained loads it)
    <dir>/step-000004/<task>/adapter_model.safetensors
    <dir>/step-000004/<task>/optimizer.safetensors  Adam moments etc., keyed like the adapter
    <dir>/step-000004/<task>/best/                its best-evaluated adapter so far, when it has one (PEFT files)
    <dir>/latest.json                             {"step": 4, "path": "step-000004"}

Whole matrices mean a run can resume on another plan (torchrun restarted it on fewer GPUs and
the planner re-planned): each rank slices what its new role holds. The learning-rate
schedule's whole state is the task's optimizer step count. No RNG state is saved: the
executor reseeds every step from ``(seed, step, rank)``, so the generators at the start of
any step are a function of the step (``window.microbatch_seed``).

**Commit** (DLRover's two phases, on one writer): rank 0 gathers the pieces, writes the step
into ``.step-000004.partial/`` with a manifest holding the SHA-256 of every other file in it,
renames it to ``step-000004/`` (``specs.io.staged_directory``; atomic on POSIX: from here the
checkpoint is committed), then
replaces ``latest.json`` (``specs.io.write_text_atomic``), a pointer for people and
tools. Older step directories beyond ``keep`` are removed after the commit.

**Resume** (:func:`resumable_checkpoint`) verifies before it trusts: the newest step directory
whose manifest reads and whose files all match their checksums wins, whatever ``latest.json``
says, and every newer one that does not is named in a warning. A
truncated tensor file, manifest or pointer therefore costs at most the steps since the
intact checkpoint before it; with none intact, resume is an InputError.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from lorafleet.errors import InputError
from lorafleet.executor.torch.inject import vera_projections
from lorafleet.executor.torch.optim import TaskOptimizer
from lorafleet.executor.torch.peft_export import (
    SAFETENSORS_WEIGHTS_NAME,
    peft_key,
    read_peft_spec,
    split_peft_key,
    vera_weights,
    write_peft_adapter,
)
from lorafleet.executor.torch.replica import Replica
from lorafleet.executor.torch.tp import shard
from lorafleet.runtime.base_quantization import MANIFEST_KEY, QuantizedBase
from lorafleet.runtime.checkpoint_files import (
    BEST_DIR,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    resumable_checkpoint,
    step_dir_name,
)
from lorafleet.specs.io import file_sha256, staged_directory, write_text_atomic
from lorafleet.specs.lora import LoraSpec

OPTIMIZER_FILE = "optimizer.safetensors"


@dataclass(frozen=True)
class TaskState:
    """One task's adapter and optimizer, as whole matrices."""

    name: str
    spec: LoraSpec
    weights: dict[tuple[str, str], Tensor]
    """(module, ``lora_A``/``lora_B``/``lora_magnitude_vector``) -> matrix (a DoRA magnitude: a vector)."""
    optimizer: dict[tuple[str, str, str], Tensor]
    """(module, factor, state key such as ``exp_avg``) -> tensor (matrix-shaped or a scalar)."""
    optimizer_steps: int


@dataclass(frozen=True)
class TrainState:
    """Everything a run needs to continue exactly."""

    step: int
    """Steps completed: the next step to run."""
    tasks: tuple[TaskState | None, ...]
    """Per task of the run (``load_train_state``'s ``names``): its state, None for one that joins later."""
    data: dict[str, Any]
    """``DataStreams.state_dict(step)``: cursors and example counts, checked on resume."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The caller's JSON-serialisable state (the training loop's, the dispatcher's)."""
    best: dict[str, dict[tuple[str, str], Tensor]] = field(default_factory=dict)
    """Task name -> the whole matrices of its adapter at its best evaluation so far (``train.evaluation``): one
    adapter copy a task, saved beside its adapter (``<task>/best/``)."""


# ---- gather (collective) and restore (local) -------------------------------------------------


def gather_task_states(
    replica: Replica,
    optimizers: Sequence[TaskOptimizer],
    specs: Sequence[LoraSpec],
    names: Sequence[str],
    *,
    only: Collection[int] | None = None,
) -> tuple[TaskState, ...] | None:
    """Whole adapters and optimizer states on rank 0 (None elsewhere). Collective over the world. With ``only`` (task
    indices), those tasks' adapters alone, without their optimizer states (a best adapter kept: ``train.evaluation``).

    Each piece is sent by its lowest holder (``GradSync.owned``): after the step every holder
    of a piece has the same bits, so one copy is enough.
    """
    local = []
    for piece in replica.grad_sync.owned:
        if only is not None and piece.param.task not in only:
            continue
        param = replica.params[piece.param.key]
        state = (
            optimizers[piece.param.task].optimizer.state.get(param, {})
            if optimizers[piece.param.task].optimizer and only is None
            else {}
        )
        moments = {
            k: (piece.local_view(v, replica.role) if v.dim() else v).detach().cpu().clone()
            for k, v in state.items()
            if isinstance(v, Tensor)
        }
        local.append((piece, piece.local_view(param.detach(), replica.role).cpu().clone(), moments))
    rank = dist.get_rank()
    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    # rank 0's own pieces are already in its memory: only the others' travel (pickled), so a
    # one-process run, or rank 0's share of any run, costs a host copy and no serialisation
    dist.gather_object(None if rank == 0 else local, gathered, dst=0)
    if gathered is None:
        return None
    gathered[0] = local
    weights: list[dict[tuple[str, str], Tensor]] = [{} for _ in names]
    moments_of: list[dict[tuple[str, str, str], Tensor]] = [{} for _ in names]
    shapes = {p.key: tuple(p.shape) for p in replica.adapter_params}

    def place(store: dict, key: tuple, value: Tensor, piece, shape: tuple[int, ...]) -> None:
        """Put one piece into its whole matrix (a piece that is the whole matrix is kept as it is)."""
        if tuple(value.shape) == shape:
            store[key] = value
            return
        if key not in store:
            store[key] = torch.zeros(shape, dtype=value.dtype)
        piece.full_view(store[key]).copy_(value)

    for piece, value, moments in (item for part in gathered for item in part):
        task, module, factor = piece.param.key
        shape = shapes[piece.param.key]
        place(weights[task], (module, factor), value, piece, shape)
        for key, tensor in moments.items():
            if tensor.dim() == 0:
                moments_of[task][(module, factor, key)] = tensor
            else:
                place(moments_of[task], (module, factor, key), tensor, piece, shape)
    for t, spec in enumerate(specs):  # a VeRA file holds its projections: redrawn from the key, as every rank drew them
        projections = vera_projections(replica.shapes, spec)
        if projections is not None and (only is None or t in only):
            weights[t].update(vera_weights(projections))
    return tuple(
        TaskState(name, spec, weights[t], moments_of[t], optimizers[t].steps_taken)
        for t, (name, spec) in enumerate(zip(names, specs, strict=True))
        if only is None or t in only
    )


def restore_task_states(
    replica: Replica, optimizers: Sequence[TaskOptimizer], states: Sequence[TaskState | None]
) -> None:
    """Loads whole-matrix states into this rank's shards and optimizers (no communication); a task whose
    state is None (it joined after the checkpoint) keeps its initial adapter and a fresh optimizer."""
    full = {p.key: p for p in replica.adapter_params}
    role = replica.role
    for (task, module, factor), param in replica.params.items():
        state = states[task]
        if state is None:
            continue
        whole = state.weights.get((module, factor))
        expected = full[(task, module, factor)].shape
        if whole is None or tuple(whole.shape) != expected:
            got = "missing" if whole is None else f"shape {tuple(whole.shape)}"
            raise InputError(state.name, f"{module}.{factor}", f"{got} in the checkpoint, the run needs {expected}")
        dim, parts = full[(task, module, factor)].shard_dim, full[(task, module, factor)].parts
        with torch.no_grad():
            param.copy_(shard(whole, dim, role.tp_rank, role.replica.tp, parts))
        moments = {key: tensor for (m, f, key), tensor in state.optimizer.items() if (m, f) == (module, factor)}
        if moments and optimizers[task].optimizer is not None:
            optimizers[task].optimizer.state[param] = {
                key: (shard(t, dim, role.tp_rank, role.replica.tp, parts) if t.dim() else t.clone()).to(param.device)
                for key, t in moments.items()
            }
    for optimizer, state in zip(optimizers, states, strict=True):
        if state is not None:
            optimizer.steps_taken = state.optimizer_steps


def check_adapter_kinds(step_dir: str | Path, state: TrainState, loras: Sequence[LoraSpec]) -> None:
    """InputError when a task's adapter kind (LoRA, DoRA or VeRA) differs between the checkpoint and the run ``loras``
    (in ``state.tasks``' order): a resume cannot turn one into another (a DoRA magnitude or VeRA vectors would be
    missing or dropped)."""
    for task, lora in zip(state.tasks, loras, strict=True):
        if task is not None and task.spec.kind != lora.kind:
            field = "lora.use_vera" if "VeRA" in (task.spec.kind, lora.kind) else "lora.use_dora"
            raise InputError(
                str(Path(step_dir) / task.name),
                field,
                f"the checkpoint's adapter is {task.spec.kind}, the run's is {lora.kind}: "
                "a resume cannot change an adapter's kind",
            )


# ---- files ----------------------------------------------------------------------------------


def _optimizer_key(module: str, factor: str, key: str) -> str:
    return f"{peft_key(module, factor)}::{key}"


def save_train_state(
    directory: str | Path,
    state: TrainState,
    *,
    base_model: str,
    quantized_base: QuantizedBase | None = None,
    keep: int = 2,
) -> Path:
    """Writes and commits one checkpoint (rank 0 only); returns its step directory. Its manifest records the
    quantized base the adapters learnt over (``runtime.base_quantization``; null: an unquantized one)."""
    root = Path(directory)
    name = step_dir_name(state.step)
    final = root / name
    with staged_directory(final) as partial:  # a re-save of the same step replaces it
        for task in state.tasks:
            write_peft_adapter(partial / task.name, task.spec, task.weights, base_model)
            moments = {_optimizer_key(*k): t.contiguous() for k, t in sorted(task.optimizer.items())}
            save_file(moments, partial / task.name / OPTIMIZER_FILE)
            if task.name in state.best:
                write_peft_adapter(partial / task.name / BEST_DIR, task.spec, state.best[task.name], base_model)
        manifest = {
            "format": FORMAT_VERSION,
            "step": state.step,
            "base_model": base_model,
            MANIFEST_KEY: quantized_base.to_json() if quantized_base is not None else None,
            "tasks": [{"name": t.name, "optimizer_steps": t.optimizer_steps} for t in state.tasks],
            "data": state.data,
            "extra": state.extra,
            "files": {str(f.relative_to(partial)): file_sha256(f) for f in sorted(partial.rglob("*")) if f.is_file()},
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    write_text_atomic(root / LATEST, json.dumps({"step": state.step, "path": name}) + "\n")
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[: max(0, len(steps) - keep)]:
        if old != final:
            shutil.rmtree(old)
    return final


def latest_step_dir(directory: str | Path) -> Path | None:
    """The newest intact committed checkpoint of ``directory``; None when there is none."""
    found = resumable_checkpoint(directory)
    return found.step_dir if found is not None else None


def load_train_state(step_dir: str | Path, names: Sequence[str], joining: Collection[str] = ()) -> TrainState:
    """Reads a committed checkpoint for the run's tasks ``names``, in that order; InputError when one of them
    is missing from it, unless it is ``joining`` (added after the checkpoint: its state is None). Tasks of
    the checkpoint the run no longer has (finished, cancelled) are left out."""
    step_dir = Path(step_dir)
    manifest_path = step_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise InputError(str(manifest_path), "", "no such file (not a committed checkpoint)") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise InputError(str(manifest_path), "format", f"expected {FORMAT_VERSION}, got {manifest.get('format')!r}")
    saved = {t["name"]: t for t in manifest["tasks"]}
    missing = [n for n in names if n not in saved and n not in joining]
    if missing:
        raise InputError(str(manifest_path), "tasks", f"checkpoint has tasks {list(saved)}, the run has {list(names)}")
    tasks: list[TaskState | None] = []
    best: dict[str, dict[tuple[str, str], Tensor]] = {}
    for name in names:
        entry = saved.get(name)
        if entry is None or name in joining:
            tasks.append(None)
            continue
        path = step_dir / entry["name"]
        spec = read_peft_spec(path)
        weights = {split_peft_key(k): t for k, t in load_file(str(path / SAFETENSORS_WEIGHTS_NAME)).items()}
        moments = {}
        for k, t in load_file(str(path / OPTIMIZER_FILE)).items():
            base, _, key = k.partition("::")
            moments[(*split_peft_key(base), key)] = t
        tasks.append(TaskState(entry["name"], spec, weights, moments, int(entry["optimizer_steps"])))
        if (path / BEST_DIR).is_dir():
            best[name] = {
                split_peft_key(k): t for k, t in load_file(str(path / BEST_DIR / SAFETENSORS_WEIGHTS_NAME)).items()
            }
    return TrainState(int(manifest["step"]), tuple(tasks), manifest["data"], manifest.get("extra", {}), best)
