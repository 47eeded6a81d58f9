"""An evaluation on the running fleet: some tasks' held-out rows, forward only, on the replicas that train them.

The coordinator draws the rows (:func:`eval_batch`: each due task's held-out rows, ``TaskData.eval_examples``), has
them dispatched like a step's (the same dispatcher, packed: ``train.evaluation``) and broadcasts the plan
(:class:`EvalRun`); every rank runs its replica's micro-batches forward only (``torch.no_grad``, the adapters'
dropout off), through its stages in order (a pipelined replica streams them forward; ``pipeline.run_stream`` keeps
nothing for a backward), and its last stage sums, per task ``t``, over the rows with a target (the tokens training
takes its loss on, ``step.target_logits``)::

    S_t = Σ_i ℓ_i,      C_t = Σ_i [argmax_v z_{i,v} = y_i]

One all-reduce of ``(S, C)`` and each rank's busy time gives rank 0

    eval_loss_t = S_t / N_t,      eval_token_accuracy_t = C_t / N_t

with ``N_t`` the task's target tokens (counted on the host): the mean token loss over the task's rows, what PEFT's
model computes on the same rows with the same adapter (``tests/executor/torch/test_evaluate.py``). ``ℓ_i`` is
computed in fp32 at least and summed in fp64. Nothing an evaluation does moves an adapter, an optimizer or a data
cursor, and no generator is drawn from (no dropout): the training after it is bitwise the same as without it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F

from lorafleet.costmodel.schedule import FORWARD
from lorafleet.executor.torch.inject import multi_lora_layers
from lorafleet.executor.torch.pipeline import run_stream
from lorafleet.executor.torch.replica import Replica
from lorafleet.executor.torch.step import build_inputs, stage_forward, target_logits
from lorafleet.plans import GlobalBatch, StepPlan
from lorafleet.runtime.data_stream import DataStreams, loss_tokens


@dataclass(frozen=True)
class EvalRun:
    """An evaluation as the coordinator broadcasts it: its plan over the rows of :func:`eval_batch`, whose
    ``sample_ids`` index each task's held-out rows."""

    plan: StepPlan
    task_ids: tuple[int, ...]
    sample_ids: tuple[int, ...]


@dataclass(frozen=True)
class EvalOutcome:
    """What an evaluation measured, by task name (rank 0)."""

    loss: dict[str, float]
    token_accuracy: dict[str, float]
    tokens: dict[str, int]
    """``N_t``: the target tokens evaluated."""
    rows: dict[str, int]
    replica_busy_s: tuple[float, ...]
    """Per replica, its slowest rank's forward time."""
    seconds: float
    """The evaluation's wall time on rank 0, broadcast to all-reduce."""


def eval_batch(streams: DataStreams, step: int, tasks: Sequence[int]) -> GlobalBatch:
    """Every held-out row of ``tasks`` (task indices) as one batch at ``step``: sample id ``k`` is the task's ``k``-th
    held-out row."""
    task_ids, sample_ids, lengths = [], [], []
    for t in tasks:
        for k, example in enumerate(streams.streams[t].data.eval_examples):
            task_ids.append(t)
            sample_ids.append(k)
            lengths.append(len(example))
    as_array = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return GlobalBatch(step, as_array(task_ids), as_array(sample_ids), as_array(lengths))


def run_evaluation(
    replica: Replica, streams: DataStreams, device: torch.device, run: EvalRun, names: Sequence[str]
) -> EvalOutcome | None:
    """This rank's part of an evaluation (module doc); rank 0 returns what it measured, the others None."""
    start = time.perf_counter()
    n_tasks, role = len(names), replica.role
    examples = [streams.streams[t].data.eval_examples[k] for t, k in zip(run.task_ids, run.sample_ids, strict=True)]
    sums = torch.zeros(2, n_tasks, dtype=torch.float64, device=device)  # S_t, C_t
    busy = 0.0
    if role is not None:
        mbs = run.plan.work[role.replica.replica_id].microbatches
        ones = [1.0] * n_tasks
        report = role.is_last_stage and role.tp_rank == 0  # TP ranks compute the same loss

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            inputs = build_inputs(mbs[i], [examples[q] for q in mbs[i].seq_ids], ones, device)
            if not role.is_last_stage:
                return stage_forward(replica.model, role, x, inputs)
            logits, targets = target_logits(replica.model, role, x, inputs)
            if report:
                tasks = inputs.token_task.view(-1).index_select(0, inputs.loss_rows)
                losses = F.cross_entropy(logits, targets, reduction="none").double()
                sums[0].index_add_(0, tasks, losses)
                sums[1].index_add_(0, tasks, (logits.argmax(dim=-1) == targets).double())
            return logits.new_zeros(())

        layers = [layer for _, layer in multi_lora_layers(replica.model)]
        began = time.perf_counter()
        with torch.no_grad():
            for layer in layers:
                layer.eval()  # no adapter dropout, and no generator drawn from
            try:
                run_stream(mbs, [(FORWARD, i) for i in range(len(mbs))], role, replica.neighbours, forward)
            finally:
                for layer in layers:
                    layer.train()
        busy = time.perf_counter() - began
    times = torch.zeros(dist.get_world_size() + 1, dtype=torch.float64)
    times[dist.get_rank()] = busy
    times[-1] = time.perf_counter() - start if dist.get_rank() == 0 else 0.0
    stats = torch.cat([sums.view(-1), times.to(device)])
    dist.all_reduce(stats)
    if dist.get_rank() != 0:
        return None
    stats = stats.cpu()
    sums, times = stats[: 2 * n_tasks].view(2, n_tasks), stats[2 * n_tasks :]
    counts: dict[int, int] = {}
    rows: dict[int, int] = {}
    for t, example in zip(run.task_ids, examples, strict=True):
        counts[t] = counts.get(t, 0) + loss_tokens(example)
        rows[t] = rows.get(t, 0) + 1
    return EvalOutcome(
        loss={names[t]: float(sums[0, t]) / n for t, n in counts.items()},
        token_accuracy={names[t]: float(sums[1, t]) / n for t, n in counts.items()},
        tokens={names[t]: n for t, n in counts.items()},
        rows={names[t]: n for t, n in rows.items()},
        replica_busy_s=tuple(float(max(times[g] for g in r.gpus)) for r in replica.fleet.replicas),
        seconds=float(times[-1]),
    )
