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

A window of consecutive steps, on every rank (``_run_window``; ``run_step`` is a window of one):

1. count ``N_t``, the loss tokens of each task in each step's whole global batch (host, no comm.);
2. run the replica's micro-batches of the whole window in one stream, 1F1B over its stages
   (``costmodel.schedule.stream_order``, ``pipeline.run_stream``): a pipelined replica does not
   drain between the window's steps. Each forward reseeds the generator from ``(seed, step, rank,
   micro-batch)`` (adapter dropout draws from it), so masks do not depend on the window;
3. as soon as this rank has run every backward of a step that holds task ``t``, submit ``t``'s
   update of that step (``updates.TaskUpdates``): its gradient sum over the holders of each piece
   (``grad_sync``) and one all-reduce of its loss and squared gradient norm run on a worker
   thread while the pipeline goes on with other tasks; the optimizer steps ``t`` (clipped by its
   norm) on this thread before ``t``'s next forward, or skips it when the loss or norm is not
   finite: the gradients are dropped, the adapter and optimizer state stay as they were (every
   rank sees the same all-reduced numbers, so every rank skips alike; other tasks' updates are
   untouched), and the report names it in ``nonfinite_tasks``;
4. at the window's end, the remaining updates, then one world all-reduce of [moved per step and
   task | busy, finished and CPU seconds per step and rank] for the reports.

Once a task has taken its warm-up steps (at least one), its adapter is compared with where it
started; one that has not moved at all (a learning rate or scale that rounds every update
away) is named in the report's ``unmoved_tasks``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
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

from lorafleet.costmodel.schedule import BACKWARD, stream_order
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
from lorafleet.executor.torch.checkpoint_files import read_manifest
from lorafleet.executor.torch.data_stream import DataStreams, task_key
from lorafleet.executor.torch.optim import TaskOptimizer
from lorafleet.executor.torch.pipeline import run_stream
from lorafleet.executor.torch.replica import build_replica
from lorafleet.executor.torch.routing import LoraBackend
from lorafleet.executor.torch.step import WindowForward, WindowStep, inverse_token_counts
from lorafleet.executor.torch.updates import UPDATE, Key, TaskUpdates, UpdateOutcome
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
    record_ops: bool = False
    """Keep every op's duration in ``TorchExecutor.op_log`` (``benchmarks/bench_pipeline.py``); off in
    training, where the log would grow with every step."""


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


def microbatch_seed(seed: int, step: int, rank: int, index: int) -> int:
    """The generator seed of one rank's forward of micro-batch ``index`` of a step (63 bits, from a
    SeedSequence): adapter dropout draws the same masks whatever the window or schedule."""
    return int(np.random.SeedSequence([seed, step, rank, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


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
            seeds=[task_key(config.seed, t.name) for t in config.tasks],
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
        self.op_log: list[tuple[int, str, int, float]] = []
        """With ``config.record_ops``, this rank's ops so far: (step, ``F``/``B``, index in its window,
        compute seconds), and its optimizer steps (step, ``U``, task, seconds), for
        ``costmodel.schedule.timeline`` replays (``benchmarks/bench_pipeline.py``)."""

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
        """Runs one dispatched step (a window of one: 1F1B, drained)."""
        return self.run_steps([step_plan])[0]

    def run_steps(self, step_plans: Sequence[StepPlan]) -> list[StepReport]:
        """Runs consecutive dispatched steps, of batches from :meth:`next_global_batch`, as one window
        on every rank: pipelined replicas stream them without draining between them (module doc)."""
        payload = []
        for step_plan in step_plans:
            batch = self._pending.pop(step_plan.step)
            check_step_plan(step_plan, batch, len(self.config.plan.replicas))
            payload.append((step_plan, tuple(int(t) for t in batch.task_ids), tuple(int(s) for s in batch.sample_ids)))
        reports = self._broadcast_and_run(Command(CommandKind.STEP, tuple(payload)))
        assert reports is not None
        return reports

    def probe(self, step_plan: StepPlan, batch: GlobalBatch) -> StepReport:
        """Times ``step_plan`` (micro-batches of ``batch``, any subset of it) on every replica without
        changing any state: forwards and backwards, the gradients dropped, no optimizer step, no
        moved-check. What it is for: how fast each replica really is before the first step (DLRover's
        node check, on the run's own work), and a fresh process's one-time costs paid outside the run."""
        payload = ((step_plan, tuple(int(t) for t in batch.task_ids), tuple(int(s) for s in batch.sample_ids)),)
        reports = self._broadcast_and_run(Command(CommandKind.PROBE, payload))
        assert reports is not None
        return reports[0]

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
        state = None
        if step_dir is not None:
            step = read_manifest(step_dir)["step"]
            joining = [n for n, j in zip(self.names, self.streams.joined, strict=True) if j >= step]
            state = load_train_state(step_dir, self.names, joining)
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
            return self._run_window(command.payload, probe=command.kind is CommandKind.PROBE)
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

    def _run_window(self, payloads: Sequence[tuple[StepPlan, Sequence[int], Sequence[int]]], probe: bool = False):
        """Runs a window of steps on this rank (module doc); rank 0 returns their reports."""
        start, cpu_start = time.perf_counter(), time.process_time()
        n_tasks, role = len(self.config.tasks), self.replica.role
        steps, stepping = [], []
        for step_plan, task_ids, sample_ids in payloads:
            examples = self.streams.examples(task_ids, sample_ids)
            inv_tokens = inverse_token_counts(task_ids, examples, n_tasks)
            mbs = step_plan.work[role.replica.replica_id].microbatches if role is not None else ()
            steps.append(
                WindowStep(step_plan.step, mbs, {q: examples[q] for mb in mbs for q in mb.seq_ids}, inv_tokens)
            )
            stepping.append([t for t in range(n_tasks) if inv_tokens[t]])
        width = len(steps)
        moved = torch.ones(width, n_tasks, dtype=torch.float64)
        last_backward = [0.0] * width  # when this rank ran each step's last backward
        forward = WindowForward(self.replica.model, role, self.device, steps) if role is not None else None

        def step_task(key: Key, outcome: UpdateOutcome) -> None:
            j, t = key
            begin = time.perf_counter()
            moved[j, t] = self._moved(t)
            if outcome.finite:
                self.optimizers[t].step(math.sqrt(outcome.squared_norm))
            else:
                self.optimizers[t].skip()
            if self.config.record_ops:
                self.op_log.append((steps[j].step, UPDATE, t, time.perf_counter() - begin))

        keys = [] if probe else [(j, t) for j in range(width) for t in stepping[j]]
        local_loss = (lambda key: float(forward.task_loss[key].item())) if forward is not None else (lambda key: 0.0)
        updates = TaskUpdates(
            keys, self.replica.grad_sync, self.replica.update_group, n_tasks, step_task, local_loss, start
        )
        if forward is not None:
            self._run_stream(forward, updates, last_backward, start)
        outcomes = updates.finish()
        if probe:  # timed, not trained on: drop the gradients
            for t in range(n_tasks):
                self.optimizers[t].skip()
        finished = [
            max([last_backward[j]] + [o.finished_s for (k, _), o in outcomes.items() if k == j]) for j in range(width)
        ]
        times = torch.zeros(3, width, self.world_size, dtype=torch.float64)  # busy, finished, CPU per step and rank
        busy = np.diff([0.0, *np.maximum.accumulate(last_backward)]) if forward is not None else np.zeros(width)
        times[0, :, self.rank] = torch.tensor(busy, dtype=torch.float64)
        times[1, :, self.rank] = torch.tensor(np.maximum.accumulate(finished), dtype=torch.float64)
        times[2, :, self.rank] = (time.process_time() - cpu_start) / width
        stats = torch.cat([moved.view(-1), times.view(-1)]).to(self.device)
        dist.all_reduce(stats)  # one collective for the moved-checks and the times of the window
        stats = stats.cpu()
        if self.rank != 0:
            return None
        moved = stats[: width * n_tasks].view(width, n_tasks)
        times = stats[width * n_tasks :].view(3, width, self.world_size)
        ends = np.concatenate([[0.0], times[1].max(dim=1).values.numpy()])
        ends[-1] = max(ends[-1], time.perf_counter() - start)
        reports = []
        for j, (step_plan, _, _) in enumerate(payloads):
            outcome = {t: outcomes[(j, t)] for t in stepping[j] if (j, t) in outcomes}
            reports.append(
                self._report(
                    step_plan,
                    losses={t: o.loss for t, o in outcome.items()} if not probe else {},
                    busy=times[0, j],
                    makespan_s=float(ends[j + 1] - ends[j]),
                    cpu=times[2, j],
                    nonfinite=[t for t, o in outcome.items() if not o.finite],
                    unmoved=[t for t in range(n_tasks) if float(moved[j, t]) == 0.0],
                )
            )
        return reports

    def _run_stream(self, forward: WindowForward, updates: TaskUpdates, last_backward: list[float], start: float):
        """This rank's ops of the window: 1F1B over its stage (``costmodel.schedule.stream_order``), each
        forward after the updates its tasks need, each task's update submitted after its last backward."""
        role = self.replica.role
        assert role is not None
        stream = forward.stream
        order = stream_order(role.replica.pp, role.stage, stream)
        left = Counter((mb.step, t) for mb in stream for t in mb.tasks)  # backwards still to run here
        factor = self.config.slowdown.get(role.replica.replica_id, 1.0)
        first: dict[int, int] = {}
        for i, mb in enumerate(stream):
            first.setdefault(mb.step, i)

        def run_forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            j, mb = forward.mbs[i]
            top = max(mb.task_ids)
            # Every update this forward may wait for is submitted (their backwards ran here: the
            # order's guarantee), then its own tasks' are applied.
            updates.submit_while(lambda key: left[key] == 0)
            if not updates.submitted((j - 1, top)):
                raise RuntimeError(f"pipeline schedule: forward {i} of the window runs before an update it needs")
            for t in sorted(set(mb.task_ids)):
                updates.apply(t)
            torch.manual_seed(microbatch_seed(self.config.seed, forward.steps[j].step, self.rank, i - first[j]))
            return forward(i, x)

        def after_op(kind: str, i: int, seconds: float) -> None:
            if factor > 1.0:  # fault injection: a replica `factor` times slower
                time.sleep((factor - 1.0) * seconds)
            if self.config.record_ops:
                self.op_log.append((forward.steps[stream[i].step].step, kind, i, seconds * factor))
            if kind == BACKWARD:
                j = stream[i].step
                for t in stream[i].tasks:
                    left[(j, t)] -= 1
                last_backward[j] = time.perf_counter() - start
                updates.submit_while(lambda key: left[key] == 0)

        mbs = [mb for _, mb in forward.mbs]
        run_stream(mbs, order, role, self.replica.neighbours, run_forward, after_op)

    def _report(
        self,
        step_plan: StepPlan,
        *,
        losses: Mapping[int, float],
        busy: torch.Tensor,
        makespan_s: float,
        cpu: torch.Tensor,
        nonfinite: Sequence[int],
        unmoved: Sequence[int],
    ) -> StepReport:
        """One step's report; its makespan runs from the previous step's last update to this one's (so
        a window's makespans add up to its wall time), a replica's busy time from its last backward
        of the previous step to its last of this one."""
        tokens, padding = step_plan.task_token_counts(self.names)
        return StepReport(
            step=step_plan.step,
            replica_busy_s=tuple(float(max(busy[g] for g in r.gpus)) for r in self.replica.fleet.replicas),
            makespan_s=makespan_s,
            task_tokens=tokens,
            task_padding_tokens=padding,
            losses={self.names[t]: loss for t, loss in losses.items()},
            nonfinite_tasks=tuple(self.names[t] for t in nonfinite),
            unmoved_tasks=tuple(self.names[t] for t in unmoved),
            estimated_makespan_s=step_plan.estimated_makespan_s,
            dispatch_solve_s=step_plan.solve_s,
            rank_cpu_s=tuple(float(c) for c in cpu),
        )
