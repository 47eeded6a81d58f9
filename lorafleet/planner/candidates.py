"""Candidate configs and deployments: enumerate, propose by throughput, filter by lower bound.

Three steps of LobRA's planner (Sec. 4.3), each a small pure function:

1. :func:`valid_candidates` — every ⟨tp, pp⟩ (with or without activation recomputation) the
   model and cluster allow and the cost model can time and fit in memory (M > 0).
2. :func:`propose_candidates` — configuration proposal: the best-throughput config per
   (max-token class, GPU count).
3. :func:`lower_bound` and :func:`lower_bound_filter` — Theorem 1: under length-based
   dispatch (every bucket on the tightest deployed config that holds it) let t_i be replica
   i's time and N_i its GPUs; then the balanced makespan t̂ of the same deployment obeys
   ``N * t̂ >= Σ_i N_i * t_i``, so ``LB = Σ_i N_i t_i / N``. Plans more than a threshold above
   the best bound are dropped, keeping a minimum number. The theorem's premise does not
   always hold, so where a plan is skipped against a makespan the planner uses the
   dispatcher's LP bound (:func:`~lorafleet.dispatch.balance.fluid_bound`) instead.

:func:`enumerate_deployments` lists every maximal deployment (every deployment, for the cost objective), for
the exhaustive mode.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import config_problems
from lorafleet.dispatch import Assignment, LoadModel
from lorafleet.planner.problem import Candidate, PlanningProblem, make_candidate
from lorafleet.specs.cluster import ClusterSpec


def valid_candidates(cost_model: CostModel, cluster: ClusterSpec) -> tuple[Candidate, ...]:
    """Every config of the cost model (with or without activation recomputation) that runs the
    model on the cluster (TP inside a node) and fits in memory, sorted."""
    return tuple(
        make_candidate(cost_model, c)
        for c in cost_model.configs
        if not config_problems(c, cost_model.model, cluster) and cost_model.max_tokens(c) > 0
    )


def max_token_class(max_tokens: int) -> int:
    """The power-of-two class of M: floor(log2 M) (LobRA's M are powers of two)."""
    return int(max_tokens).bit_length() - 1


def _rank(c: Candidate) -> tuple[float, int, int, bool]:
    """Sort key, best first: throughput, then fewer pipeline stages, then the config order (no recompute first)."""
    return (-c.throughput, c.config.pp, c.config.tp, c.config.recompute)


def propose_candidates(candidates: Sequence[Candidate], longest: int) -> tuple[Candidate, ...]:
    """LobRA's configuration proposal: the best-throughput config per (max-token class, GPU
    count), and the best one without pipeline stages of each such group as well; configs with
    and without activation recomputation are proposed apart (so the plain ones are exactly
    those a ``recompute: off`` workload gets).

    That is their paper's ``GROUP BY num_gpus, seq_len`` rule (their code drops, within a
    class, GPU counts above the best config's; on this repository's test instances that
    loses up to 5 % against exhaustive search, so the paper's rule it is). Their throughput
    prices a pipeline's bubble over 16 micro-batches, more than a replica gets when
    heterogeneous replicas share a step, so it favours pipelines: the best unpipelined
    config of a group is kept too (with recomputing variants, a ``<2,1,rc>`` that the
    rule dropped for ``<1,2,rc>`` made a 7B plan 2.9% faster). The best config whose M
    holds the longest sequence is always kept, so a class boundary never removes every
    config that can. On a fleet of several pools the rule runs in each pool: a config's
    throughput is its pool's kind's, and each pool needs its own configs (its GPU budget).
    """
    groups: dict[tuple[str, int, int, bool, bool], list[Candidate]] = {}
    for c in candidates:
        key = (c.config.pool, max_token_class(c.max_tokens), c.n_gpus, c.config.pp > 1, c.config.recompute)
        groups.setdefault(key, []).append(c)
    kept = {min(members, key=_rank) for members in groups.values()}
    for pool in dict.fromkeys(c.config.pool for c in candidates):
        holders = [c for c in candidates if c.max_tokens >= longest and c.config.pool == pool]
        if holders:
            kept.add(min(holders, key=_rank))
    return tuple(sorted(kept, key=lambda c: c.config))


def spread_rows(total: np.ndarray, replicas: int) -> np.ndarray:
    """Rows per replica, shape (replicas, R), when each bucket's ``total`` is split as evenly as possible.

    Every replica gets floor(d_j / p) of bucket j; the d_j mod p extra rows go round-robin,
    continuing where the previous bucket's extras stopped, so no replica collects them all.
    """
    total = np.asarray(total, dtype=np.int64)
    rows = np.repeat((total // replicas)[None, :], replicas, axis=0)
    start = 0
    for j, extra in enumerate(total % replicas):
        rows[(start + np.arange(extra)) % replicas, j] += 1
        start = (start + int(extra)) % replicas
    return rows


def lower_bound(load: LoadModel, length_based: Assignment) -> float:
    """LobRA's Theorem 1 bound ``Σ_r N_r t_r / Σ_r N_r`` over the replicas r of a deployment.

    t_r is replica r's time under the length-based dispatch ``length_based`` (every bucket
    only on the deployed configs with the least M >= s_j, balanced among them, each
    config's share spread evenly over its replicas) and N_r its GPUs. Theorem 1 assumes a
    higher average-throughput bound means a higher realised per-GPU throughput, which
    fails with few sequences per micro-batch and with pipelines (whose bubble a long bucket
    may leave for a larger-M config), so the bound only compares plans: it exceeds the
    balanced makespan of some deployments (``tests/planner/test_search.py``), where
    :func:`~lorafleet.dispatch.balance.fluid_bound` cannot.
    """
    gpu_time = gpus = 0.0
    for k, cls in enumerate(load.classes):
        rows = spread_rows(length_based.counts[k], len(cls.replicas))
        gpu_time += cls.config.n_gpus * float(load.replica_load(k, rows).sum())
        gpus += cls.config.n_gpus * len(cls.replicas)
    return gpu_time / gpus


def lower_bound_filter(
    bounds: Sequence[float], distinct_m: Sequence[bool], threshold: float, keep_at_least: int
) -> list[int]:
    """Indices of the plans that survive, lowest bound first.

    The reference bound is the lowest over plans whose configs all have distinct M (as in
    LobRA's code; all plans when none has); plans above ``(1 + threshold)`` times it are
    dropped, but the ``keep_at_least`` lowest always survive.
    """
    order = sorted(range(len(bounds)), key=lambda k: (bounds[k], k))
    reference_pool = [bounds[k] for k in order if distinct_m[k]] or [bounds[k] for k in order]
    reference = min(reference_pool) if reference_pool else float("inf")
    return [k for rank, k in enumerate(order) if rank < keep_at_least or bounds[k] <= (1 + threshold) * reference]


def has_distinct_max_tokens(problem: PlanningProblem, replicas: np.ndarray) -> bool:
    deployed = [problem.candidates[i].max_tokens for i in np.flatnonzero(np.asarray(replicas) > 0)]
    return len(deployed) == len(set(deployed))


def enumerate_deployments(problem: PlanningProblem, limit: int, maximal: bool = True) -> Iterator[np.ndarray]:
    """Every maximal deployment (no further replica of any candidate fits) that holds every
    non-empty bucket, as count vectors p; every deployment that holds them, maximal or not, when not
    ``maximal`` (the cost objective's reference: GPUs not held cost nothing).

    Raises:
        ValueError: more than ``limit`` deployments exist (the instance is too large to enumerate).
    """
    rows, caps = problem.gpu_budget_rows()
    n_cand = len(problem.candidates)
    found = 0

    def extend(i: int, p: np.ndarray, left: np.ndarray) -> Iterator[np.ndarray]:
        nonlocal found
        if i == n_cand:
            full = not maximal or not any(np.all(rows[:, k] <= left) for k in range(n_cand))
            if full and problem.covers(p):
                found += 1
                if found > limit:
                    raise ValueError(f"more than {limit} deployments: too many to enumerate")
                yield p.copy()
            return
        col = rows[:, i]
        most = int(min(left[r] // col[r] for r in range(len(caps)) if col[r] > 0))
        for count in range(most, -1, -1):
            p[i] = count
            yield from extend(i + 1, p, left - count * col)
        p[i] = 0

    yield from extend(0, np.zeros(n_cand, dtype=np.int64), caps.copy())
