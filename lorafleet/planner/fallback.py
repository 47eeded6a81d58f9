"""A deployment without a solver: the heuristic the planner starts from and falls back to.

Length-based fluid greedy:

1. Support. Each non-empty bucket goes to the tightest memory class that holds it
   (least M_i >= s_j), represented by its best-throughput candidate. While one replica of
   every chosen config does not fit the GPUs, the smallest class is merged into the next
   larger one (its buckets move up).
2. Counts. With W_i = Σ_j D_j w_ij the fluid work of config i (w_ij = t(b_ij, s_j) / b_ij)
   and a_i its fixed time per replica (overhead and bubble, ``deployment_ilp.fixed_time``),
   a replica goes, one at a time, to the config with the largest W_i / p_i + a_i among
   those that still fit, until none does.

The fluid time ``max_i W_i / p_i + a_i`` it reaches is a feasible point of the aggregated
MILP, hence an upper bound on that model's optimum.
"""

from __future__ import annotations

import numpy as np

from lorafleet.planner.deployment_ilp import fixed_time
from lorafleet.planner.problem import PlanningProblem


def _support(problem: PlanningProblem) -> dict[int, list[int]]:
    """Chosen config -> the buckets it takes, before merging."""
    present = np.flatnonzero(problem.counts > 0)
    chosen: dict[int, list[int]] = {}
    for j in present:
        holders = [i for i in range(len(problem.candidates)) if problem.microbatch_size[i, j] > 0]
        if not holders:
            raise ValueError(f"bucket {j} (length {int(problem.boundaries[j])}) fits no candidate config")
        tightest = min(problem.candidates[i].max_tokens for i in holders)
        best = max(
            (i for i in holders if problem.candidates[i].max_tokens == tightest),
            key=lambda i: (problem.candidates[i].throughput, -i),
        )
        chosen.setdefault(best, []).append(int(j))
    return chosen


def heuristic_deployment(problem: PlanningProblem) -> tuple[np.ndarray, float]:
    """Replica counts p (shape (C,)) and their fluid makespan ``max_i W_i / p_i + a_i``.

    Raises:
        ValueError: not even one replica of the config holding the longest bucket fits.
    """
    chosen = _support(problem)
    replicas = np.zeros(len(problem.candidates), dtype=np.int64)
    for i in chosen:
        replicas[i] = 1
    while not problem.fits(replicas):
        if len(chosen) == 1:
            raise ValueError("one replica of the config that holds the longest sequence does not fit the GPUs")
        smallest, larger = sorted(chosen, key=lambda i: problem.candidates[i].max_tokens)[:2]
        chosen[larger] += chosen.pop(smallest)
        replicas[smallest] = 0
    w = problem.amortised_time
    work = np.zeros(len(problem.candidates))
    for i, buckets in chosen.items():
        work[i] = float(problem.counts[buckets] @ w[i, buckets])
    fixed = fixed_time(problem)
    while True:
        room = [i for i in chosen if problem.fits(replicas + np.eye(len(replicas), dtype=np.int64)[i])]
        if not room:
            break
        busiest = max(room, key=lambda i: (work[i] / replicas[i] + fixed[i], -i))
        replicas[busiest] += 1
    deployed = replicas > 0
    return replicas, float(np.max(work[deployed] / replicas[deployed] + fixed[deployed]))
