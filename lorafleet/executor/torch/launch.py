"""Process start-up: torchrun or not, gloo or NCCL, and every rank's identical executor build.

lorafleet adds no launcher of its own (DESIGN, "Scale"): a multi-process run is started by
``torch.distributed.run`` (torchrun), either by the user (any rendezvous, many nodes) or by
``lorafleet train`` re-executing itself under ``torchrun --standalone`` on one machine.
Either way each process reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous
address from the environment torchrun sets.

The backend follows the device: NCCL when the ranks compute on CUDA devices (one per local
rank), gloo on CPU. Every rank then builds the same :class:`TorchExecutor` from the same
workload spec and plan (:func:`build_torch_executor`): data, tokenizer and model are loaded
by every rank, so nothing but the plans and the adapter gradients travels between them. The
model is loaded per stage where its source allows (``base_model.load_base``): a rank reads
only the base weights of its own stage and TP shard.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from lorafleet.data.model_source import resolve_model_source
from lorafleet.errors import InputError, StartTimeout
from lorafleet.executor.torch.base_model import load_base
from lorafleet.executor.torch.quantized_base import QuantizedLinear
from lorafleet.executor.torch.quantized_stage import load_quantized_base
from lorafleet.executor.torch.worker import ExecutorConfig, TaskTraining, TorchExecutor
from lorafleet.plans import DeploymentPlan
from lorafleet.runtime.base_quantization import QuantizedBase
from lorafleet.runtime.data_stream import TaskData, prepare_task_data, task_tokenizer, training_streams
from lorafleet.runtime.processes import START_TIMEOUT_S
from lorafleet.specs.gpus import GIB, gpu_preset_for
from lorafleet.specs.model import adapter_base_model, resolve_model
from lorafleet.specs.workload import TaskSpec, WorkloadSpec
from lorafleet.turns import TaskTurns

_TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")


def init_distributed(device: str = "auto", start_timeout_s: float = START_TIMEOUT_S) -> torch.device:
    """Joins the process group torchrun set up; returns this rank's device.

    The group must form within ``start_timeout_s`` seconds (:func:`form_group`), not the backend's
    collective timeout (30 minutes for gloo, 10 for NCCL, which torch would otherwise wait for a rank
    that never arrives).

    Args:
        device: ``cuda`` (one GPU per local rank, NCCL), ``cpu`` (gloo), or ``auto`` (CUDA when
            there are enough GPUs for the local ranks).
        start_timeout_s: seconds the ranks have to meet.
    """
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "cpu"
    if device == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise InputError(
                "<args>", "--device", f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)"
            )
        torch.cuda.set_device(local_rank)
        form_group("nccl", start_timeout_s, device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise InputError("<args>", "--device", f"expected auto, cpu or cuda, got {device!r}")
    form_group("gloo", start_timeout_s)
    return torch.device("cpu")


def form_group(backend: str, start_timeout_s: float, **kwargs: Any) -> None:
    """``init_process_group`` (env://, from torchrun's variables) bounded by ``start_timeout_s``: the store
    waits that long for every rank (and a rank for the store), gloo and NCCL connect within it. A timeout is a
    :class:`~lorafleet.errors.StartTimeout` saying how many ranks came (torch's message): the worker ends, and
    torchrun restarts the group (``--max-restarts``) or the launcher says so in one line. Once formed, the
    group's collectives get the backend's default timeout back (a step or a checkpoint may take longer than
    the start)."""
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=start_timeout_s), **kwargs)
    except RuntimeError as err:  # DistStoreError: ranks did not join; DistNetworkError: no store to join
        if not _TIMED_OUT.search(str(err)):
            raise
        said = " ".join(str(err).split("\n")[0].split())
        raise StartTimeout(
            f"the process group did not form within {start_timeout_s:g} s (--start-timeout): {said}"
        ) from err
    run_timeout = default_pg_nccl_timeout if backend == "nccl" else default_pg_timeout
    dist.distributed_c10d._set_pg_timeout(run_timeout)


def device_kind(device: torch.device) -> tuple[str | None, str]:
    """This rank's device as a GPU kind (a ``GPU_PRESETS`` name) and in words: ``("cpu", "cpu")`` on CPU,
    ``("H200-141GB", "NVIDIA H200 (139.8 GiB)")`` for a CUDA device (``torch.cuda.get_device_name``); no
    kind when no preset names it."""
    if device.type != "cuda":
        return "cpu", "cpu"
    props = torch.cuda.get_device_properties(device)
    return gpu_preset_for(props.name, props.total_memory), f"{props.name} ({props.total_memory / GIB:.1f} GiB)"


def check_device_kinds(plan: DeploymentPlan, device: torch.device, source: str) -> None:
    """Collective, once the group is up: every rank's device is of the GPU kind of the pool the plan puts the
    rank in (its replicas are priced, and were placed, by that kind). Otherwise rank 0 raises an InputError
    naming the first rank that is not, its pool and the device found, and the other ranks exit with code 2
    without a word (one line for the run, not one per rank)."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, device_kind(device))
    for rank, (kind, words) in enumerate(found):
        k, pool = plan.pool_at(rank)
        if kind is not None and kind.lower() == pool.gpu.lower():
            continue
        if dist.get_rank() != 0:
            raise SystemExit(2)
        where = f"pool {pool.name!r}" if pool.name else "the cluster"
        raise InputError(
            source,
            f"pools[{k}].gpu",
            f"rank {rank} is in {where} of {pool.gpu} GPUs, but its device is {words}: "
            + (
                "start each pool's nodes in the plan's pool order (ranks number pool after pool)"
                if len(plan.pools) > 1
                else f"plan for the devices the job runs on (--gpu {kind or 'KIND'})"
            ),
        )


def build_torch_executor(
    spec: WorkloadSpec,
    plan: DeploymentPlan,
    run_steps: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    slowdown: Mapping[int, float] | None = None,
    turn_changes: Mapping[str, tuple] | None = None,
    departed: Sequence[TaskTurns] = (),
    report: Callable[[str], None] | None = None,
    tokenizer: Any | None = None,
) -> TorchExecutor:
    """This rank's executor for a workload (data paths resolved) and a plan (checked by the caller:
    ``lorafleet.plan_check``). Collective. ``slowdown`` injects stragglers (``ExecutorConfig.slowdown``).
    A task's learning-rate schedule spans its own steps (:func:`task_training`).
    ``report``, when given, is told each phase as it ends (the data tokenized, the base model loaded).
    ``tokenizer``: the workload's (:func:`task_tokenizer`), when the caller has it already."""
    source = resolve_model_source(spec.model, source="workload", field="model", seed=spec.seed)
    tokenizer = tokenizer if tokenizer is not None else task_tokenizer(spec)
    streams = training_streams(spec, run_steps, tokenizer, turn_changes, departed)
    if report is not None:
        examples = [stream.data.examples for stream in streams.streams]
        tokens = sum(len(e.input_ids) for task in examples for e in task)
        report(f"tokenized: {len(examples)} tasks, {sum(map(len, examples)):,} examples, {tokens:,} tokens")
    tasks = tuple(task_training(t, limit, run_steps) for t, limit in zip(spec.tasks, streams.max_batches, strict=True))
    config = ExecutorConfig(
        plan=plan,
        tasks=tasks,
        seed=spec.seed,
        base_model=adapter_base_model(spec.model, spec.base_model_id),
        quantized_base=QuantizedBase(spec.quantize, str(dtype).removeprefix("torch.")) if spec.quantize else None,
        model_spec=resolve_model(spec.model),
        slowdown=dict(slowdown or {}),
    )
    start = time.perf_counter()
    if spec.quantize is None:
        loader = partial(load_base, source, dtype)
    else:  # QLoRA: its projections quantized (the launcher's preflight refused a GGUF: base_quantization)
        loader = partial(load_quantized_base, source, dtype, spec.quantize)
    model, weights = loader()
    if report is not None:
        params = sum(p.numel() for p in model.parameters()) / 1e6
        params += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear)) / 1e6
        precision = str(dtype).removeprefix("torch.")
        precision += f", projections {spec.quantize.value}" if spec.quantize is not None else ""
        report(f"base model loaded: {config.base_model}, {params:,.1f}M parameters, {precision}")
    executor = TorchExecutor(
        config,
        model,
        streams,
        device,
        weights=weights,
        base=loader,
        task_data=partial(_added_task_data, tokenizer=tokenizer),
    )
    executor.stage_build_s = time.perf_counter() - start
    return executor


def task_training(task: TaskSpec, limit: int | None, run_steps: int) -> TaskTraining:
    """A task as the executor trains it: its learning-rate schedule spans its own ``limit`` of batches (its ``steps``
    or ``epochs``: ``data_stream.task_batches``), whatever the run's ``--steps`` (a run that ends before the task
    cuts its schedule short, never squeezes it; a resume with other ``--steps`` leaves it as it was); a task without
    either spans the run's steps from its start (``train.run_length``)."""
    total = max(1, limit if limit is not None else run_steps - task.start_step)
    return TaskTraining(name=task.name, lora=task.lora, optimizer=task.optimizer, total_steps=total)


def _added_task_data(task: TaskSpec, *, tokenizer: Any) -> TaskData:
    """A task added to the running fleet: its data tokenized as the launch tokenized the others'."""
    return prepare_task_data(task, tokenizer, task.data.path if task.data is not None else "queue")
