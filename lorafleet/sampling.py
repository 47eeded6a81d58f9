"""Sampling global batches from a workload's length distributions, deterministically.

One rule draws every sampled batch: task ``name``'s ``batch_size`` lengths at step t of a run with
seed s come from a generator seeded by (s, t, 64 bits of SHA-256 of the name) (:func:`task_rng`,
:func:`task_lengths`). So any step can be re-drawn alone (look-ahead, resume, what-ifs), two runs
with the same seed see the same batches, and a task's batches depend on its name only, never on the
tasks beside it or on its place among them: a task queued into a running job, added by an arrival
trace or resumed after a re-plan draws what the same task draws in any workload file. A sweep's members draw by
their sweep's name (``TaskSpec.seed_name``): the same batches, as in training. The step is the
caller's: ``simulate``, ``plan`` and ``dispatch`` draw at the global step
(:func:`sample_global_batch`), the arrivals replay at the task's own step.

Lengths are drawn from the task's *raw* distribution and then the overflow rule is applied and
counted (:func:`lorafleet.specs.workload.fit_to_context`): ``truncate`` clips to the context length,
``reject`` drops the sequence and draws a replacement from the kept distribution.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from lorafleet.plans import GlobalBatch
from lorafleet.specs.workload import fit_to_context
from lorafleet.turns import TaskTurns
from lorafleet.workload import Task, Workload


def workload_turns(workload: Workload) -> list[TaskTurns]:
    """Each task's turns (``lorafleet.turns``) as a simulation draws them: its share and deadline, a batch's
    expected tokens from its length distribution; its ``steps`` bound it only where a deadline needs them
    (a simulation runs the steps it is told)."""
    return [
        TaskTurns(
            tokens=task.batch_size * float(np.dot(task.lengths.lengths, task.lengths.probs)),
            batches=task.spec.steps if task.spec.deadline is not None else None,
            share=task.spec.share,
            deadline=task.spec.deadline,
        )
        for task in workload.tasks
    ]


class TaskDraw(NamedTuple):
    """One task's sequences of one step (:func:`task_lengths`)."""

    lengths: np.ndarray
    """int64, ``batch_size`` of them, each at most the task's context length."""
    truncated: int
    """Drawn longer than the context length and cut to it."""
    rejected: int
    """Drawn longer than the context length, dropped and drawn again from the kept distribution."""


def task_rng(seed: int, step: int, name: str) -> np.random.Generator:
    """The generator of task ``name``'s draw at step ``step`` (the module's one rule)."""
    key = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, step, key]))


def task_lengths(task: Task, step: int, seed: int) -> TaskDraw:
    """Task ``task``'s sequences at step ``step``, drawn from :func:`task_rng`."""
    rng = task_rng(seed, step, task.spec.seed_name)
    n = task.batch_size
    fit = fit_to_context(task.raw_lengths.sample(n, rng), task.spec.context_length, task.spec.overflow)
    drawn = fit.lengths
    if fit.rejected.any():
        drawn[fit.rejected] = task.lengths.sample(int(fit.rejected.sum()), rng)
    return TaskDraw(drawn.astype(np.int64), int(fit.truncated.sum()), int(fit.rejected.sum()))


def global_batch(step: int, draws: Sequence[tuple[int, int, TaskDraw]]) -> GlobalBatch:
    """Global step ``step``'s batch of the draws ``(task id, the step it was drawn at, draw)``, in that order:
    a task's sample ids at draw step s are ``s * batch_size ...`` (each draw names its own sequences)."""
    return GlobalBatch(
        step=step,
        task_ids=np.concatenate([np.full(d.lengths.size, k, dtype=np.int64) for k, _, d in draws]),
        sample_ids=np.concatenate(
            [np.arange(s * d.lengths.size, (s + 1) * d.lengths.size, dtype=np.int64) for _, s, d in draws]
        ),
        lengths=np.concatenate([d.lengths for _, _, d in draws]),
        truncated=sum(d.truncated for _, _, d in draws),
        rejected=sum(d.rejected for _, _, d in draws),
    )


def sample_global_batch(workload: Workload, step: int, seed: int | None = None) -> GlobalBatch:
    """Step ``step``'s global batch: every task's ``batch_size`` sequences drawn at ``step``, grouped by task
    (task ids index ``workload.tasks``)."""
    seed = workload.spec.seed if seed is None else seed
    return global_batch(step, [(k, step, task_lengths(task, step, seed)) for k, task in enumerate(workload.tasks)])
