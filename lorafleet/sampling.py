"""Sampling global batches from a workload's length distributions, deterministically.

Step t of a run with seed s draws task k's ``batch_size`` lengths from a generator seeded
by (s, t, k), so any step can be re-drawn alone (look-ahead, resume, what-ifs) and two
runs with the same seed see the same batches. Lengths are drawn from the task's *raw*
distribution and then the overflow rule is applied and counted
(:func:`lorafleet.specs.workload.fit_to_context`): ``truncate`` clips to the context length,
``reject`` drops the sequence and draws a replacement from the kept distribution.
"""

from __future__ import annotations

import numpy as np

from lorafleet.plans import GlobalBatch
from lorafleet.specs.workload import fit_to_context
from lorafleet.turns import TaskTurns
from lorafleet.workload import Workload


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


def task_rng(seed: int, step: int, task_index: int) -> np.random.Generator:
    """The generator of one task's draw at one step."""
    return np.random.default_rng(np.random.SeedSequence([seed, step, task_index]))


def sample_global_batch(workload: Workload, step: int, seed: int | None = None) -> GlobalBatch:
    """Step ``step``'s global batch: every task's ``batch_size`` sequences, grouped by task."""
    seed = workload.spec.seed if seed is None else seed
    task_ids, sample_ids, lengths = [], [], []
    truncated = rejected = 0
    for k, task in enumerate(workload.tasks):
        rng = task_rng(seed, step, k)
        n = task.batch_size
        fit = fit_to_context(task.raw_lengths.sample(n, rng), task.spec.context_length, task.spec.overflow)
        truncated += int(fit.truncated.sum())
        rejected += int(fit.rejected.sum())
        drawn = fit.lengths
        if fit.rejected.any():
            drawn[fit.rejected] = task.lengths.sample(int(fit.rejected.sum()), rng)
        task_ids.append(np.full(n, k, dtype=np.int64))
        sample_ids.append(np.arange(step * n, (step + 1) * n, dtype=np.int64))
        lengths.append(drawn.astype(np.int64))
    return GlobalBatch(
        step=step,
        task_ids=np.concatenate(task_ids),
        sample_ids=np.concatenate(sample_ids),
        lengths=np.concatenate(lengths),
        truncated=truncated,
        rejected=rejected,
    )
