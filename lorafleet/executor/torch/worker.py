"""The torch executor: rank 0 coordinates, every rank runs its replica's share of each step.

Every rank runs the same program. Rank 0 (the coordinator) runs the training loop: it
draws global batches (:meth:`TorchExecutor.next_global_batch`, a pure function of the step,
so a dispatcher may draw the next one ahead), has them dispatched, and calls
:meth:`TorchExecutor.run_step`, which broadcasts the StepPlan to every rank
(``broadcast_object_list``) and then runs rank 0's own share. The other ranks sit in
:meth:`TorchExecutor.serve`, executing each broadcast command, until the coordinator sends
STOP. Checkpoint saves and restores travel the same way, so every collective is entered by
every rank in the same order.

Checkpoints do not stall training (DLRover's flash checkpoint): a SAVE gathers every adapter
and optimizer piece into rank 0's host memory (the only part the ranks wait for), and a
background thread writes and commits it while the next steps run. One write is in flight at a
time; the next SAVE, :meth:`TorchExecutor.flush_checkpoints` and :meth:`TorchExecutor.close`
wait for it, and a failed write raises there. A process killed mid-write leaves that
checkpoint uncommitted, so a resume takes the one before.

One step, on every rank (``_run_step``):

1. reseed the generators from ``(seed, step, rank)`` (adapter dropout draws from them);
2. count ``N_t``, the loss tokens of each task in the whole global batch (host, no comm.);
3. run the replica's micro-batches, 1F1B over its stages (``step.run_rank_step``);
4. sum adapter gradients over the holders of each piece (``grad_sync``);
5. one world all-reduce of [loss per task | squared gradient norm per task | moved per task |
   busy, elapsed and CPU seconds per rank];
6. step the optimizer of every task that had sequences in the batch, clipped by its norm,
   unless its loss or gradient norm is not finite: then the task's gradients are dropped and
   its adapter and optimizer state stay as they were (every rank sees the same all-reduced
   numbers, so every rank skips alike; other tasks' updates are untouched, bitwise), and the
   report names it in ``nonfinite_tasks``.

Once a task has taken its warm-up steps (at least one), its adapter is compared with where it
started; one that has not moved at all (a learning rate or scale that rounds every update
away) is named in the report's ``unmoved_tasks``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lorafleet.errors import InputError
from lorafleet.executor.torch.base_model import SafetensorsWeights
from lorafleet.executor.torch.checkpoint import (
    TrainState,
    gather_task_states,
    latest_step_dir,
    load_train_state,
    restore_task_states,
    save_train_state,
    step_dir_name,
)
from lorafleet.executor.torch.data_stream import DataStreams
from lorafleet.executor.torch.optim import TaskOptimizer
from lorafleet.executor.torch.replica import build_replica
from lorafleet.executor.torch.routing import LoraBackend
from lorafleet.executor.torch.step import RankStepResult, inverse_token_counts, run_rank_step
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan, StepReport
from lorafleet.specs.lora import LoraSpec, OptimizerSpec


@dataclass(frozen=True, kw_only=True)
class TaskTraining:
    """One task as the executor trains it."""

    name: str
    lora: LoraSpec
    optimizer: OptimizerSpec
    total_steps: int
    """Optimizer steps the schedule spans (the task's ``steps``, or the run's)."""


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """Everything every rank must agree on to build the same fleet."""

    plan: DeploymentPlan
    tasks: tuple[TaskTraining, ...]
    seed: int = 0
    """Seed of the initial adapters and of every step's generators."""
    base_model: str = ""
    """The base model's name, written into each adapter's ``base_model_name_or_path``."""
    lora_backend: LoraBackend = LoraBackend.AUTO
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """Fault injection: replica id -> factor f >= 1. The replica's ranks wait (f - 1) x their compute time
    after each step's micro-batches, as a replica f times slower would take (stragglers in tests and
    benchmarks; the busy time reported includes the wait)."""


class CommandKind(StrEnum):
    STEP = "step"
    PROBE = "probe"
    SAVE = "save"
    RESTORE = "restore"
    STOP = "stop"


@dataclass(frozen=True)
class Command:
    """What the coordinator broadcasts; ``payload`` depends on ``kind``."""

    kind: CommandKind
    payload: Any = None


def step_seed(seed: int, step: int, rank: int) -> int:
    """The generator seed of one rank at one step (63 bits, from a SeedSequence)."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


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
    ) -> None:
        """Builds this rank's replica from the full ``model``, or from its meta skeleton and the
        checkpoint ``weights`` (per-stage loading, ``base_model.load_base``). Collective: every rank calls it."""
        self.config = config
        self.streams = streams
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.names = tuple(t.name for t in config.tasks)
        self.replica = build_replica(
            model,
            [t.lora for t in config.tasks],
            config.plan,
            self.rank,
            self.world_size,
            seed=config.seed,
            device=device,
            backend=config.lora_backend,
            weights=weights,
        )
        self.optimizers = [
            TaskOptimizer(t.optimizer, self.replica.task_params(i), t.total_steps) for i, t in enumerate(config.tasks)
        ]
        self._pending: dict[int, GlobalBatch] = {}
        self._initial = self._snapshot()
        self._writer = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafleet-checkpoint") if self.rank == 0 else None
        )
        self._writing: Future[Path] | None = None

    def _snapshot(self) -> dict[int, list[torch.Tensor]]:
        """Each task's local adapter shards as they start (kept until the task's moved-check)."""
        return {t: [p.detach().clone() for p in self.replica.task_params(t)] for t in range(len(self.config.tasks))}

    def _moved(self, t: int) -> float:
        """1.0 unless task t is at its moved-check (``max(warm-up, 1)`` steps taken) and this rank's
        shards of its adapter are exactly where they started (then 0.0; summed over ranks)."""
        check_at = max(self.config.tasks[t].optimizer.warmup_steps, 1)
        if t not in self._initial or self.optimizers[t].steps_taken != check_at:
            return 1.0
        start = self._initial.pop(t)
        return float(
            any(not torch.equal(p.detach(), q) for p, q in zip(self.replica.task_params(t), start, strict=True))
        )

    # ---- coordinator (rank 0) -----------------------------------------------------------------

    def next_global_batch(self, step: int) -> GlobalBatch:
        """Step ``step``'s batch from the task streams, kept for :meth:`run_step` (thread-safe: a
        look-ahead dispatcher calls it for step + 1 while step runs)."""
        batch = self._pending[step] = self.streams.global_batch(step)
        return batch

    def run_step(self, step_plan: StepPlan) -> StepReport:
        """Runs a dispatched step of a batch from :meth:`next_global_batch` on every rank."""
        batch = self._pending.pop(step_plan.step)
        check_step_plan(step_plan, batch, len(self.config.plan.replicas))
        payload = (step_plan, tuple(int(t) for t in batch.task_ids), tuple(int(s) for s in batch.sample_ids))
        report = self._broadcast_and_run(Command(CommandKind.STEP, payload))
        assert report is not None
        return report

    def probe(self, step_plan: StepPlan, batch: GlobalBatch) -> StepReport:
        """Times ``step_plan`` (micro-batches of ``batch``, any subset of it) on every replica without
        changing any state: forwards and backwards, the gradients dropped, no optimizer step, no
        moved-check. What it is for: how fast each replica really is before the first step (DLRover's
        node check, on the run's own work), and a fresh process's one-time costs paid outside the run."""
        payload = (step_plan, tuple(int(t) for t in batch.task_ids), tuple(int(s) for s in batch.sample_ids), True)
        report = self._broadcast_and_run(Command(CommandKind.PROBE, payload))
        assert report is not None
        return report

    def save_checkpoint(
        self, directory: str | Path, step: int, extra: dict[str, Any] | None = None, *, wait: bool = False
    ) -> Path:
        """Checkpoints the state after ``step`` completed steps; returns its directory, which is committed
        once the background write ends (at once with ``wait``; see the module docstring)."""
        path = self._broadcast_and_run(Command(CommandKind.SAVE, (str(directory), step, extra or {})))
        assert path is not None
        if wait:
            self.flush_checkpoints()
        return path

    def flush_checkpoints(self) -> None:
        """Waits for the checkpoint being written, if any; re-raises its error."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def restore_checkpoint(self, directory: str | Path) -> TrainState | None:
        """Loads the latest committed checkpoint of ``directory`` on every rank; None when there is none.

        The returned state's ``step`` is the next step to run and ``extra`` the caller's state.
        """
        self.flush_checkpoints()
        step_dir = latest_step_dir(directory)
        state = load_train_state(step_dir, self.names) if step_dir is not None else None
        if state is not None:
            try:
                self.streams.check_state(state.data)
            except ValueError as err:
                raise InputError(str(step_dir), "data", str(err)) from None
        self._broadcast_and_run(Command(CommandKind.RESTORE, state))
        return state

    def close(self) -> None:
        """Finishes the checkpoint being written and releases the other ranks from :meth:`serve`."""
        try:
            self.flush_checkpoints()
        finally:
            self._broadcast_and_run(Command(CommandKind.STOP))
            if self._writer is not None:
                self._writer.shutdown(wait=True)

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
            return self._run_step(*command.payload)
        if command.kind is CommandKind.SAVE:
            directory, step, extra = command.payload
            if self.rank == 0:
                self.flush_checkpoints()  # one write in flight, commits in step order
            states = gather_task_states(self.replica, self.optimizers, [t.lora for t in self.config.tasks], self.names)
            if states is None:
                return None
            state = TrainState(step, states, self.streams.state_dict(step), extra)
            assert self._writer is not None
            self._writing = self._writer.submit(save_train_state, directory, state, base_model=self.config.base_model)
            return Path(directory) / step_dir_name(step)
        if command.kind is CommandKind.RESTORE:
            if command.payload is not None:
                restore_task_states(self.replica, self.optimizers, command.payload.tasks)
                # a task restored mid-warm-up cannot be compared with its start any more
                self._initial = {t: v for t, v in self._snapshot().items() if self.optimizers[t].steps_taken == 0}
            return command.payload
        return None

    def _run_step(
        self, step_plan: StepPlan, task_ids: Sequence[int], sample_ids: Sequence[int], probe: bool = False
    ) -> StepReport | None:
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.manual_seed(step_seed(self.config.seed, step_plan.step, self.rank))
        n_tasks = len(self.config.tasks)
        examples = self.streams.examples(task_ids, sample_ids)
        inv_tokens = inverse_token_counts(task_ids, examples, n_tasks)
        stepping = [t for t in range(n_tasks) if inv_tokens[t]]
        role = self.replica.role
        if role is None:
            result = RankStepResult(torch.zeros(n_tasks, dtype=torch.float64), 0.0)
        else:
            microbatches = step_plan.work[role.replica.replica_id].microbatches
            needed = {q: examples[q] for mb in microbatches for q in mb.seq_ids}
            result = run_rank_step(self.replica.model, role, self.replica.neighbours, microbatches, needed, inv_tokens)
            factor = self.config.slowdown.get(role.replica.replica_id, 1.0)
            if factor > 1.0:
                waited = time.perf_counter()
                time.sleep((factor - 1.0) * result.busy_s)
                result = RankStepResult(result.task_loss, result.busy_s + time.perf_counter() - waited)
        if probe:  # timed, not trained on: drop the gradients before they are summed
            for t in stepping:
                self.optimizers[t].skip()
            stepping = []
        self.replica.grad_sync.all_reduce(stepping)
        times = torch.zeros(3, self.world_size, dtype=torch.float64)  # busy, elapsed, CPU up to here, per rank
        times[:, self.rank] = torch.tensor(
            [result.busy_s, time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64
        )
        moved = torch.tensor([1.0 if probe else self._moved(t) for t in range(n_tasks)], dtype=torch.float64)
        stats = torch.cat(
            [result.task_loss.cpu(), self.replica.grad_sync.squared_norms(n_tasks, stepping), moved, times.view(-1)]
        )
        stats = stats.to(self.device)
        dist.all_reduce(stats)  # one collective for losses, norms, moved-checks and times
        stats = stats.cpu()
        synced = time.perf_counter()
        nonfinite = [
            t for t in stepping if not (math.isfinite(float(stats[t])) and math.isfinite(float(stats[n_tasks + t])))
        ]
        for t in stepping:
            if t in nonfinite:
                self.optimizers[t].skip()
            else:
                self.optimizers[t].step(math.sqrt(float(stats[n_tasks + t])))
        if self.rank != 0:
            return None
        unmoved = [t for t in range(n_tasks) if float(stats[2 * n_tasks + t]) == 0.0]
        return self._report(step_plan, stats, stepping, time.perf_counter() - synced, nonfinite, unmoved)

    def _report(
        self,
        step_plan: StepPlan,
        stats: torch.Tensor,
        stepping: Sequence[int],
        optimizer_s: float,
        nonfinite: Sequence[int],
        unmoved: Sequence[int],
    ) -> StepReport:
        """The step's report; its makespan is the slowest rank's time up to the gradient sync's end
        plus the optimizer step (so no replica's busy time can exceed it)."""
        n_tasks = len(self.names)
        busy, elapsed, cpu = stats[3 * n_tasks :].view(3, self.world_size)
        tokens = dict.fromkeys(self.names, 0)
        padding = dict.fromkeys(self.names, 0)
        for work in step_plan.work:
            for mb in work.microbatches:
                for task, length in zip(mb.task_ids, mb.lengths, strict=True):
                    tokens[self.names[task]] += length
                    padding[self.names[task]] += mb.padded_len - length if mb.padded_len is not None else 0
        return StepReport(
            step=step_plan.step,
            replica_busy_s=tuple(float(max(busy[g] for g in r.gpus)) for r in self.replica.fleet.replicas),
            makespan_s=float(elapsed.max()) + optimizer_s,
            task_tokens=tokens,
            task_padding_tokens=padding,
            losses={self.names[t]: float(stats[t]) for t in stepping},
            nonfinite_tasks=tuple(self.names[t] for t in nonfinite),
            unmoved_tasks=tuple(self.names[t] for t in unmoved),
            estimated_makespan_s=step_plan.estimated_makespan_s,
            dispatch_solve_s=step_plan.solve_s,
            rank_cpu_s=tuple(float(c) for c in cpu),
        )
