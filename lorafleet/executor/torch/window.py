"""A window of consecutive steps on one rank: :class:`WindowRunner` runs the StepPlans the coordinator
broadcast (``worker.TorchExecutor``; ``run_step`` is a window of one) and rank 0 collects their StepReports.

1. count ``N_t``, the loss tokens of each task in each step's whole global batch (host, no comm.);
2. run the replica's micro-batches of the whole window in one stream, 1F1B over its stages
   (``costmodel.schedule.stream_order``, ``pipeline.run_stream``): a pipelined replica does not
   drain between the window's steps. Each forward reseeds the generator from ``(seed, step, the stage's
   first rank, micro-batch)`` (:func:`microbatch_seed`; adapter dropout draws from it), so masks do not depend on
   the window;
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

Why a component of its own (torchtitan's ``train_step`` beside its ``CheckpointManager``): this is the
executor's hot path, every rank's, and it shares nothing with the command protocol or the checkpoints
but the replica and the optimizers it is handed.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from lorafleet.costmodel.schedule import BACKWARD, stream_order
from lorafleet.executor.torch.optim import TaskOptimizer
from lorafleet.executor.torch.pipeline import run_stream
from lorafleet.executor.torch.replica import Replica
from lorafleet.executor.torch.step import WindowForward, WindowStep, inverse_token_counts
from lorafleet.executor.torch.updates import UPDATE, Key, TaskUpdates, UpdateOutcome
from lorafleet.plans import GlobalBatch, StepPlan, StepReport
from lorafleet.runtime.data_stream import DataStreams


def microbatch_seed(seed: int, step: int, rank: int, index: int) -> int:
    """The generator seed of a stage's forward of micro-batch ``index`` of a step (63 bits, from a SeedSequence):
    adapter dropout draws the same masks whatever the window or schedule. ``rank`` is the stage's first TP rank
    (``RankRole.stage_leader``), so every TP rank of a stage draws the same masks: a column-parallel projection's
    ranks each keep their rows of the one dropped input for ``dA`` (``token_split.py``)."""
    return int(np.random.SeedSequence([seed, step, rank, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass(frozen=True)
class BroadcastStep:
    """One step of a window as the coordinator broadcasts it: its plan and its global batch's sequences
    (every rank holds the examples; the ids pick them)."""

    plan: StepPlan
    task_ids: tuple[int, ...]
    sample_ids: tuple[int, ...]

    @classmethod
    def of(cls, step_plan: StepPlan, batch: GlobalBatch) -> BroadcastStep:
        return cls(step_plan, tuple(int(t) for t in batch.task_ids), tuple(int(s) for s in batch.sample_ids))


class WindowRunner:
    """This rank's windows of steps (module docstring) over its part of the replica and its task optimizers."""

    def __init__(
        self,
        replica: Replica,
        optimizers: Sequence[TaskOptimizer],
        streams: DataStreams,
        device: torch.device,
        names: Sequence[str],
        *,
        seed: int,
        slowdown: Mapping[int, float],
        record_ops: bool,
    ) -> None:
        """``seed``, ``slowdown`` and ``record_ops`` are ``ExecutorConfig``'s (the executor's config)."""
        self.replica, self.optimizers, self.streams, self.device = replica, optimizers, streams, device
        self.names = tuple(names)
        self.seed, self.slowdown, self.record_ops = seed, slowdown, record_ops
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._initial = self._snapshot()
        self.op_log: list[tuple[int, str, int, float]] = []
        """With ``record_ops``, this rank's ops so far: (step, ``F``/``B``, index in its window,
        compute seconds), and its optimizer steps (step, ``U``, task, seconds), for
        ``costmodel.schedule.timeline`` replays (``benchmarks/bench_pipeline.py``)."""

    def _snapshot(self) -> dict[int, list[torch.Tensor]]:
        """Each task's local adapter shards as they start (kept until the task's moved-check)."""
        return {t: [p.detach().clone() for p in self.replica.task_params(t)] for t in range(len(self.names))}

    def restored(self) -> None:
        """After a checkpoint was loaded: a task restored mid-warm-up cannot be compared with its start any
        more, so only those that have not stepped yet are checked."""
        self._initial = {t: v for t, v in self._snapshot().items() if self.optimizers[t].steps_taken == 0}

    def changed(
        self,
        replica: Replica,
        optimizers: Sequence[TaskOptimizer],
        streams: DataStreams,
        names: Sequence[str],
        kept: Mapping[int, int] | None,
    ) -> WindowRunner:
        """This runner over a fleet changed at a boundary (``change.py``), its op log carried. ``kept`` (new task
        -> old) when this rank kept its stage: the staying tasks keep their starting adapters for the moved-check
        and the new ones start now; None for a new stage, which is checked as a restored one (:meth:`restored`). A
        rank left idle (its stage gone: a replica dropped) compares no shards, whatever ``kept`` says."""
        runner = WindowRunner(
            replica,
            optimizers,
            streams,
            self.device,
            names,
            seed=self.seed,
            slowdown=self.slowdown,
            record_ops=self.record_ops,
        )
        runner.op_log = self.op_log
        if replica.model is None:  # an idle rank holds no shard of any task: its (empty) starts are exact
            return runner
        if kept is None:
            runner.restored()
        else:
            runner._initial = {
                t: self._initial[kept[t]] if t in kept else start
                for t, start in runner._initial.items()
                if t not in kept or kept[t] in self._initial
            }
        return runner

    def _moved(self, t: int) -> float:
        """1.0 unless task t is at its moved-check (``max(warm-up, 1)`` steps taken) and this rank's
        shards of its adapter are exactly where they started (then 0.0; summed over ranks)."""
        check_at = max(self.optimizers[t].spec.warmup_steps, 1)
        if t not in self._initial or self.optimizers[t].steps_taken != check_at:
            return 1.0
        start = self._initial.pop(t)
        return float(
            any(not torch.equal(p.detach(), q) for p, q in zip(self.replica.task_params(t), start, strict=True))
        )

    def run(self, window: Sequence[BroadcastStep], probe: bool = False) -> list[StepReport] | None:
        """Runs a window of steps on this rank (module doc); rank 0 returns their reports, the others None.
        A ``probe`` runs forwards and backwards and then drops the gradients: no update, no moved-check."""
        start, cpu_start = time.perf_counter(), time.process_time()
        n_tasks, role = len(self.names), self.replica.role
        steps, stepping = [], []
        for item in window:
            examples = self.streams.examples(item.task_ids, item.sample_ids)
            inv_tokens = inverse_token_counts(item.task_ids, examples, n_tasks)
            mbs = item.plan.work[role.replica.replica_id].microbatches if role is not None else ()
            steps.append(
                WindowStep(item.plan.step, mbs, {q: examples[q] for mb in mbs for q in mb.seq_ids}, inv_tokens)
            )
            stepping.append([t for t in range(n_tasks) if inv_tokens[t]])
        width = len(steps)
        moved = torch.ones(width, n_tasks, dtype=torch.float64)
        last_backward = [0.0] * width  # when this rank ran each step's last backward
        forward = WindowForward(self.replica.model, role, self.device, steps) if role is not None else None

        rates: dict[Key, float] = {}  # each update's learning rate, for the reports

        def step_task(key: Key, outcome: UpdateOutcome) -> None:
            j, t = key
            begin = time.perf_counter()
            moved[j, t] = self._moved(t)
            if outcome.finite:
                rates[key] = self.optimizers[t].step(math.sqrt(outcome.squared_norm))
            else:
                self.optimizers[t].skip()
            if self.record_ops:
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
        for j, item in enumerate(window):
            outcome = {t: outcomes[(j, t)] for t in stepping[j] if (j, t) in outcomes}
            reports.append(
                self._report(
                    item.plan,
                    losses={t: o.loss for t, o in outcome.items()} if not probe else {},
                    busy=times[0, j],
                    makespan_s=float(ends[j + 1] - ends[j]),
                    cpu=times[2, j],
                    nonfinite=[t for t, o in outcome.items() if not o.finite],
                    unmoved=[t for t in range(n_tasks) if float(moved[j, t]) == 0.0],
                    rates={t: rates[(j, t)] for t in outcome if (j, t) in rates},
                    norms={t: math.sqrt(o.squared_norm) for t, o in outcome.items() if o.finite},
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
        factor = self.slowdown.get(role.replica.replica_id, 1.0)
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
            torch.manual_seed(microbatch_seed(self.seed, forward.steps[j].step, role.stage_leader, i - first[j]))
            return forward(i, x)

        def after_op(kind: str, i: int, seconds: float) -> None:
            if factor > 1.0:  # fault injection: a replica `factor` times slower
                time.sleep((factor - 1.0) * seconds)
            if self.record_ops:
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
        rates: Mapping[int, float],
        norms: Mapping[int, float],
    ) -> StepReport:
        """One step's report; its makespan runs from the previous step's last update to this one's (so
        a window's makespans add up to its wall time), a replica's busy time from its last backward
        of the previous step to its last of this one; each updated task's learning rate (``rates``), gradient norm
        (``norms``) and epochs done (the rows its batches drew up to this step over its rows)."""
        tokens, padding = step_plan.task_token_counts(self.names)
        streams, after = self.streams, step_plan.step + 1
        epochs = {
            self.names[t]: streams.batches_taken(t, after) * streams.batch_sizes[t] / len(s.data.examples)
            for t, s in enumerate(streams.streams)
            if tokens.get(self.names[t])
        }
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
            task_lr={self.names[t]: lr for t, lr in rates.items()},
            task_grad_norm={self.names[t]: norm for t, norm in norms.items()},
            task_epoch=epochs,
        )
