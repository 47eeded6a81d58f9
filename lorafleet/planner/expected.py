"""The expected global batch the deployment is planned on.

LobRA plans on expected bucket counts ``round(P_t(j) * GBS_t)`` with the longest bucket
forced to 1. lorafleet takes the same idea one step further and builds an actual
:class:`~lorafleet.plans.GlobalBatch`: task t contributes its ``batch_size`` quantile points
``F_t^{-1}((k + 1/2) / GBS_t)``, k = 0..GBS_t - 1, of its trained-on length distribution
(after the overflow policy), and the longest length any task can present replaces the top
point of its task, so the plan always holds the longest sequence a step can bring. Being
a real batch, it goes through the same bucketing and dispatch code as every sampled step.
"""

from __future__ import annotations

import numpy as np

from lorafleet.plans import GlobalBatch
from lorafleet.workload import Workload

EXPECTED_STEP = -1
"""Step number of the expected batch (no training step has it)."""


def quantile_lengths(lengths: np.ndarray, probs: np.ndarray, n: int) -> np.ndarray:
    """The n mid-quantiles ``F^{-1}((k + 1/2) / n)`` of a discrete distribution, ascending."""
    cdf = np.cumsum(probs)
    q = (np.arange(n) + 0.5) / n
    return np.asarray(lengths)[np.minimum(np.searchsorted(cdf, q * cdf[-1], side="left"), len(lengths) - 1)]


def expected_global_batch(workload: Workload) -> GlobalBatch:
    """Every task's ``batch_size`` mid-quantile lengths, grouped by task, with the longest length included."""
    task_ids, lengths = [], []
    for k, task in enumerate(workload.tasks):
        task_ids.append(np.full(task.batch_size, k, dtype=np.int64))
        lengths.append(quantile_lengths(task.lengths.lengths, task.lengths.probs, task.batch_size).astype(np.int64))
    longest = max(range(len(workload.tasks)), key=lambda k: (workload.tasks[k].lengths.max_length, -k))
    lengths[longest][-1] = workload.tasks[longest].lengths.max_length
    all_tasks = np.concatenate(task_ids)
    return GlobalBatch(
        step=EXPECTED_STEP,
        task_ids=all_tasks,
        sample_ids=np.arange(all_tasks.size, dtype=np.int64),
        lengths=np.concatenate(lengths),
    )
