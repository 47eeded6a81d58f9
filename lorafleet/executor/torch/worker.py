"""The torch executor: rank 0 coordinates, every rank runs its replica's share of each step.

Every rank runs the same program. Rank 0 (the coordinator) runs the training loop: it
draws global batches (:meth:`TorchExecutor.next_global_batch`, a pure function of the step,
so a dispatcher may draw the next one ahead), has them dispatched, and calls
:meth:`TorchExecutor.run_steps` (or ``run_step``, a window of one), which broadcasts the window's
StepPlans to every rank (``broadcast_object_list``) and then runs rank 0's own share. The other ranks
sit in :meth:`TorchExecutor.serve`, executing each broadcast command, until the coordinator sends
STOP. Checkpoint saves and restores travel the same way, so every collective is entered by
every rank in the same order.

The executor decides what every rank does next; two components do it:

- ``window.WindowRunner``: a window of steps on this rank (the 1F1B stream, each task's update as
  soon as its backwards are done, the moved-checks) and, on rank 0, the window's StepReports;
- ``checkpointer.Checkpointer``: flash checkpoints (gathered into rank 0's memory, written and
  committed by a background thread) and their restore.

An evaluation (some tasks' held-out rows, forward only: ``evaluate``) and keeping a task's adapter as its best
are two more commands (``train.evaluation`` decides when). A change of the running fleet (tasks joining or leaving,
a new deployment) is one more command:
:meth:`TorchExecutor.change` broadcasts a ``change.FleetChange`` at a step boundary, every rank changes its
part of the fleet in place (``change.change_fleet``), and the next step runs on it; no process restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lorafleet.executor.torch.base_model import SafetensorsWeights
from lorafleet.executor.torch.change import (
    PHASES,
    BaseSource,
    ChangeReport,
    FleetChange,
    TaskTraining,
    change_fleet,
)
from lorafleet.executor.torch.checkpoint import TrainState
from lorafleet.executor.torch.checkpointer import Checkpointer
from lorafleet.executor.torch.evaluate import EvalOutcome, EvalRun, eval_batch, run_evaluation
from lorafleet.executor.torch.mask_memory import keep_masks_up_to, replica_mask_tokens
from lorafleet.executor.torch.optim import LORAPLUS_FACTORS, TaskOptimizer
from lorafleet.executor.torch.replica import build_replica
from lorafleet.executor.torch.routing import LoraBackend
from lorafleet.executor.torch.window import BroadcastStep, WindowRunner
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan, StepReport
from lorafleet.runtime.base_quantization import QuantizedBase
from lorafleet.runtime.data_stream import DataStreams, TaskData, task_key
from lorafleet.specs.architecture import model_lora
from lorafleet.specs.model import ModelSpec
from lorafleet.specs.workload import TaskSpec


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """Everything every rank must agree on to build the same fleet."""

    plan: DeploymentPlan
    tasks: tuple[TaskTraining, ...]
    seed: int = 0
    """Seed of the initial adapters and of every step's generators."""
    base_model: str = ""
    """The base model's name, written into each adapter's ``base_model_name_or_path``."""
    quantized_base: QuantizedBase | None = None
    """The base's projections stored quantized (QLoRA: ``quantized_base.py``), recorded in every checkpoint."""
    lora_backend: LoraBackend = LoraBackend.AUTO
    model_spec: ModelSpec | None = None
    """The base model's shape (``specs.model``): what the memory model prices a replica's dropout keep-masks by, so
    its layers keep them where they fit (``mask_memory.py``); None: every layer draws its masks again."""
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """Fault injection: replica id -> factor f >= 1. The replica's ranks wait (f - 1) x their compute time
    after each step's micro-batches, as a replica f times slower would take (stragglers in tests and
    benchmarks; the busy time reported includes the wait)."""
    record_ops: bool = False
    """Keep every op's duration in ``TorchExecutor.op_log`` (``benchmarks/bench_pipeline.py``); off in
    training, where the log would grow with every step."""


class CommandKind(StrEnum):
    STEP = "step"
    PROBE = "probe"
    SAVE = "save"
    RESTORE = "restore"
    CHANGE = "change"
    EVAL = "eval"
    KEEP_BEST = "keep_best"
    STOP = "stop"


@dataclass(frozen=True)
class Command:
    """What the coordinator broadcasts; ``payload`` depends on ``kind``."""

    kind: CommandKind
    payload: Any = None


def check_step_plan(step_plan: StepPlan, batch: GlobalBatch, n_replicas: int) -> None:
    """Every sequence of ``batch`` in exactly one micro-batch, with its task and length; ValueError otherwise.

    A dropped or doubled sequence would silently change ``N_t``-normalised losses.
    """
    if step_plan.step != batch.step:
        raise ValueError(f"step plan is for step {step_plan.step}, the batch for step {batch.step}")
    if len(step_plan.work) != n_replicas:
        raise ValueError(f"step plan has work for {len(step_plan.work)} replicas, the deployment has {n_replicas}")
    seen = np.zeros(len(batch), dtype=np.int64)
    for work in step_plan.work:
        for mb in work.microbatches:
            for q, task, length in zip(mb.seq_ids, mb.task_ids, mb.lengths, strict=True):
                if not 0 <= q < len(batch) or task != batch.task_ids[q] or length != batch.lengths[q]:
                    raise ValueError(f"step {batch.step}: sequence {q} does not match the global batch")
                seen[q] += 1
    if (seen != 1).any():
        bad = int(np.flatnonzero(seen != 1)[0])
        raise ValueError(f"step {batch.step}: sequence {bad} is in {int(seen[bad])} micro-batches, expected 1")


def _for_model(tasks: Sequence[TaskTraining], model_type: str) -> tuple[TaskTraining, ...]:
    """The tasks with their LoRA targets as the model names its projections (Phi-3's fused ones:
    ``specs.architecture.model_lora``); the workload was checked against them already (``validate``/``plan``)."""
    return tuple(replace(t, lora=model_lora(t.lora, model_type)) for t in tasks)


class TorchExecutor:
    """An :class:`~lorafleet.executor.Executor` over torch.distributed replicas (see the module doc)."""

    def __init__(
        self,
        config: ExecutorConfig,
        model: nn.Module,
        streams: DataStreams,
        device: torch.device,
        *,
        weights: SafetensorsWeights | None = None,
        base: BaseSource | None = None,
        task_data: Callable[[TaskSpec], TaskData] | None = None,
    ) -> None:
        """Builds this rank's replica from the full ``model``, or from its meta skeleton and the
        checkpoint ``weights`` (per-stage loading, ``base_model.load_base``). Collective: every rank calls it.

        For :meth:`change`: ``base`` gives the base model again when a rank must build a new stage, and
        ``task_data`` prepares a new task's data (tokenizes it; rank 0's is used)."""
        self.model_type = model.config.model_type
        config = replace(config, tasks=_for_model(config.tasks, self.model_type))
        self.config = config
        self.streams = streams
        self.device = device
        self.base, self.task_data = base, task_data
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.names = tuple(t.name for t in config.tasks)
        self.replica = build_replica(
            model,
            [t.lora for t in config.tasks],
            config.plan,
            self.rank,
            self.world_size,
            seeds=[task_key(config.seed, t.name) for t in config.tasks],
            device=device,
            backend=config.lora_backend,
            weights=weights,
        )
        self._keep_masks()
        self.optimizers = [
            TaskOptimizer(
                t.optimizer,
                self.replica.task_params(i),
                t.total_steps,
                lr_ratio=t.lora.lr_ratio,
                fast=self.replica.task_params(i, LORAPLUS_FACTORS),
            )
            for i, t in enumerate(config.tasks)
        ]
        self._pending: dict[int, GlobalBatch] = {}
        self._prepared: dict[str, TaskData] = {}
        """Rank 0, during a change: the new tasks' data it was handed (``change``)."""
        self.windows = WindowRunner(
            self.replica,
            self.optimizers,
            streams,
            device,
            self.names,
            seed=config.seed,
            slowdown=config.slowdown,
            record_ops=config.record_ops,
        )
        self.checkpointer = Checkpointer(
            self.replica,
            self.optimizers,
            streams,
            [t.lora for t in config.tasks],
            self.names,
            config.base_model,
            config.quantized_base,
        )
        self.op_log = self.windows.op_log
        """With ``config.record_ops``, this rank's ops so far (``WindowRunner.op_log``)."""
        self.stage_build_s = 0.0
        """Seconds this rank took to get its base model and build its stage (``launch.build_torch_executor``)."""

    # ---- coordinator (rank 0) -----------------------------------------------------------------

    def next_global_batch(self, step: int) -> GlobalBatch:
        """Step ``step``'s batch from the task streams, kept for :meth:`run_step` (thread-safe: a
        look-ahead dispatcher calls it for step + 1 while step runs)."""
        batch = self._pending[step] = self.streams.global_batch(step)
        return batch

    def _keep_masks(self) -> None:
        """This rank's layers keep their dropout keep-masks in micro-batches the memory model fits them in (the
        replica's :func:`~lorafleet.executor.torch.mask_memory.replica_mask_tokens`): at start and after a change."""
        role, config = self.replica.role, self.config
        if role is None or not config.tasks:
            return
        quantize = None if config.quantized_base is None else config.quantized_base.kind
        loras, optimizer = [t.lora for t in config.tasks], config.tasks[0].optimizer.name
        tokens = replica_mask_tokens(
            config.model_spec, config.plan, role.replica.replica_id, loras, optimizer, quantize
        )
        keep_masks_up_to(self.replica.model, tokens)

    def run_step(self, step_plan: StepPlan) -> StepReport:
        """Runs one dispatched step (a window of one: 1F1B, drained)."""
        return self.run_steps([step_plan])[0]

    def run_steps(self, step_plans: Sequence[StepPlan]) -> list[StepReport]:
        """Runs consecutive dispatched steps, of batches from :meth:`next_global_batch`, as one window
        on every rank: pipelined replicas stream them without draining between them (``window``)."""
        window = []
        for step_plan in step_plans:
            batch = self._pending.pop(step_plan.step)
            check_step_plan(step_plan, batch, len(self.config.plan.replicas))
            window.append(BroadcastStep.of(step_plan, batch))
        reports = self._broadcast_and_run(Command(CommandKind.STEP, tuple(window)))
        assert reports is not None
        return reports

    def probe(self, step_plan: StepPlan, batch: GlobalBatch) -> StepReport:
        """Times ``step_plan`` (micro-batches of ``batch``, any subset of it) on every replica without
        changing any state: forwards and backwards, the gradients dropped, no optimizer step, no
        moved-check. What it is for: how fast each replica really is before the first step (DLRover's
        node check, on the run's own work), and a fresh process's one-time costs paid outside the run."""
        reports = self._broadcast_and_run(Command(CommandKind.PROBE, (BroadcastStep.of(step_plan, batch),)))
        assert reports is not None
        return reports[0]

    def eval_batch(self, step: int, names: Sequence[str]) -> GlobalBatch:
        """The held-out rows of the tasks ``names`` as one batch at ``step`` (``evaluate.eval_batch``)."""
        return eval_batch(self.streams, step, [self.names.index(n) for n in names])

    def evaluate(self, step_plan: StepPlan, batch: GlobalBatch) -> EvalOutcome:
        """Runs an evaluation of :meth:`eval_batch`'s rows, dispatched as ``step_plan``, on every rank, forward only
        (``evaluate``); changes no training state."""
        check_step_plan(step_plan, batch, len(self.config.plan.replicas))
        run = EvalRun(step_plan, tuple(int(t) for t in batch.task_ids), tuple(int(s) for s in batch.sample_ids))
        outcome = self._broadcast_and_run(Command(CommandKind.EVAL, run))
        assert outcome is not None
        return outcome

    def keep_best(self, names: Sequence[str]) -> None:
        """The adapters of ``names`` as they are now, kept as their best (``Checkpointer.keep_best``; collective)."""
        self._broadcast_and_run(Command(CommandKind.KEEP_BEST, tuple(self.names.index(n) for n in names)))

    def save_checkpoint(
        self, directory: str | Path, step: int, extra: dict[str, Any] | None = None, *, wait: bool = False
    ) -> Path:
        """Checkpoints the state after ``step`` completed steps; returns its directory, which is committed
        once the background write ends (at once with ``wait``; ``checkpointer``)."""
        path = self._broadcast_and_run(Command(CommandKind.SAVE, (str(directory), step, extra or {})))
        assert path is not None
        if wait:
            self.flush_checkpoints()
        return path

    def flush_checkpoints(self) -> None:
        """Waits for the checkpoint being written, if any; re-raises its error."""
        self.checkpointer.flush()

    def restore_checkpoint(self, directory: str | Path) -> TrainState | None:
        """Loads the latest committed checkpoint of ``directory`` on every rank; None when there is none.

        The returned state's ``step`` is the next step to run and ``extra`` the caller's state.
        """
        self.flush_checkpoints()
        state = self.checkpointer.latest(directory)
        self._broadcast_and_run(Command(CommandKind.RESTORE, state))
        return state

    def change(self, change: FleetChange, data: Mapping[str, TaskData] | None = None) -> ChangeReport:
        """Changes the running fleet at the boundary before ``change.step`` (``change.py``): its tasks and their
        turns, its deployment; every rank in place. A checkpoint being written goes on meanwhile. ``data``: new
        tasks' data rank 0 has prepared already (the queue's check tokenized it); the others prepare theirs."""
        start = time.perf_counter()
        self._prepared = dict(data or {})
        report = self._broadcast_and_run(Command(CommandKind.CHANGE, change))
        assert report is not None
        return replace(report, seconds=time.perf_counter() - start)

    def close(self) -> None:
        """Finishes the checkpoint being written and releases the other ranks from :meth:`serve`."""
        try:
            self.flush_checkpoints()
        finally:
            self._broadcast_and_run(Command(CommandKind.STOP))
            self.checkpointer.close()

    def _broadcast_and_run(self, command: Command) -> Any:
        if self.rank != 0:
            raise RuntimeError("only rank 0 coordinates; other ranks call serve()")
        return self._execute(self._broadcast(command))

    # ---- every other rank -----------------------------------------------------------------------

    def serve(self) -> None:
        """Executes the coordinator's commands until STOP."""
        while (command := self._broadcast(None)).kind is not CommandKind.STOP:
            self._execute(command)

    # ---- every rank -----------------------------------------------------------------------------

    def _broadcast(self, command: Command | None) -> Command:
        box = [command]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def _execute(self, command: Command) -> Any:
        if command.kind in (CommandKind.STEP, CommandKind.PROBE):
            return self.windows.run(command.payload, probe=command.kind is CommandKind.PROBE)
        if command.kind is CommandKind.SAVE:
            return self.checkpointer.save(*command.payload)
        if command.kind is CommandKind.CHANGE:
            return self._change(command.payload)
        if command.kind is CommandKind.EVAL:
            return run_evaluation(self.replica, self.streams, self.device, command.payload, self.names)
        if command.kind is CommandKind.KEEP_BEST:
            return self.checkpointer.keep_best(command.payload)
        if command.kind is CommandKind.RESTORE:
            if command.payload is not None:
                self.checkpointer.restore(command.payload)
                self.windows.restored()
            return command.payload
        return None

    def _change(self, change: FleetChange) -> ChangeReport | None:
        """This rank's part of a change (``change.change_fleet``); rank 0 returns what it cost."""
        change = replace(change, tasks=_for_model(change.tasks, self.model_type))
        old = {name: t for t, name in enumerate(self.names)}
        groups_before = self.replica.groups.created
        prepared, self._prepared = self._prepared, {}

        def task_data(spec: TaskSpec) -> TaskData:  # rank 0 only (change.change_fleet sends it to the others)
            if spec.name in prepared:
                return prepared.pop(spec.name)
            if self.task_data is None:
                raise RuntimeError("the executor was given no way to prepare a new task's data (task_data)")
            return self.task_data(spec)

        replica, optimizers, streams, phases, kept_stage = change_fleet(
            self.replica,
            self.optimizers,
            self.streams,
            self.config.tasks,
            change,
            seed=self.config.seed,
            device=self.device,
            backend=self.config.lora_backend,
            base=self.base,
            task_data=task_data,
        )
        created = replica.groups.created - groups_before
        names = tuple(t.name for t in change.tasks)
        kept = {t: old[n] for t, n in enumerate(names) if n in old} if kept_stage else None
        self.windows = self.windows.changed(replica, optimizers, streams, names, kept)
        self.op_log = self.windows.op_log
        self.checkpointer.retask(replica, optimizers, streams, [t.lora for t in change.tasks], names)
        self.config = replace(self.config, plan=change.plan, tasks=change.tasks)
        self.replica, self.optimizers, self.streams, self.names = replica, optimizers, streams, names
        self._keep_masks()
        self._pending.clear()  # batches drawn ahead for the old tasks
        # One all-reduce each: the slowest rank's seconds per phase, and which ranks built a stage.
        slowest = torch.tensor([phases[p] for p in PHASES], dtype=torch.float64).to(self.device)
        built = torch.zeros(self.world_size, dtype=torch.float64)
        built[self.rank] = float(not kept_stage and replica.role is not None)
        built = built.to(self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(built)
        if self.rank != 0:
            return None
        rebuilt = tuple(int(r) for r in torch.nonzero(built.cpu()).flatten())
        return ChangeReport(0.0, dict(zip(PHASES, slowest.cpu().tolist(), strict=True)), rebuilt, created)
