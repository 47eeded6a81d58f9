"""Per-task fairness of a dispatch: how each task's tokens spread over the replicas."""

from __future__ import annotations

import numpy as np

from lorafleet.plans import StepPlan


def task_tokens_per_replica(step_plan: StepPlan, n_tasks: int) -> np.ndarray:
    """(replicas, tasks) real (unpadded) tokens of each task on each replica, in ``step_plan.work`` order."""
    tokens = np.zeros((len(step_plan.work), n_tasks), dtype=np.int64)
    for r, work in enumerate(step_plan.work):
        for mb in work.microbatches:
            np.add.at(tokens[r], np.asarray(mb.task_ids, dtype=np.int64), np.asarray(mb.lengths, dtype=np.int64))
    return tokens
