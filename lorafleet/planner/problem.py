"""The planning problem: candidate configs i x planning buckets j of the expected batch.

Notation (LobRA, Sec. 4 and Appendix D): bucket j holds D_j sequences of the expected
global batch padded to its upper length s_j; config i = ⟨tp_i, pp_i⟩ uses N_i = tp_i pp_i
GPUs and holds micro-batches of at most M_i tokens, so a full micro-batch of bucket j has
b_ij = floor(M_i / s_j) rows (0: config i cannot hold bucket j). A micro-batch of b rows
takes the stage time t(b, s_j) = α_ij b + β_ij (Eq. 10 is affine in b), and a replica given
n_ij rows of each bucket takes (Eq. 12, 1F1B, plus the step overhead o_i)::

    T_i = o_i + Σ_j [ α_ij n_ij + β_ij ceil(n_ij / b_ij) ] + (pp_i - 1) max_{j: n_ij > 0} t(min(n_ij, b_ij), s_j)

That closed form, the bucketing DP and the balancers that minimise the slowest T_i for a
fixed deployment belong to the dispatcher (:mod:`lorafleet.dispatch`); the planner reuses
them, so a deployment is judged by the very model its steps will be dispatched with
(:meth:`PlanningProblem.plan_view`). The planning buckets, shared by all candidates, feed
the optimisation models only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from lorafleet.accounting import SECONDS_PER_HOUR
from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.dispatch import (
    Assignment,
    ConfigClass,
    LoadModel,
    bucket_load,
    bucket_of,
    build_load_model,
    choose_buckets,
    optimal_buckets,
)
from lorafleet.plans import GlobalBatch
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.dispatch import DispatchMethod, DispatchPolicy

LOBRA_PROFILE_MICROBATCHES = 16
"""Micro-batches of one M-token sequence in LobRA's throughput probe (their code, notes Sec. 2.4)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A config the planner may deploy, with the figures the proposal step ranks it by."""

    config: ParallelConfig
    max_tokens: int
    """M: tokens (padding included) one micro-batch may hold."""
    throughput: float
    """LobRA's probe: tokens/s per GPU running 16 micro-batches of one M-token sequence."""

    @property
    def n_gpus(self) -> int:
        return self.config.n_gpus


def lobra_throughput(cost_model: CostModel, config: ParallelConfig) -> float:
    """Tokens/s per GPU of 16 micro-batches of one M-token sequence (LobRA's proposal probe)::

    latency = t(1, M) * (16 + pp - 1),   throughput = 16 * M / (latency * tp * pp)

    The bubble here stays LobRA's ``pp - 1`` (1F1B flushed) whatever the pipeline window: the
    probe reproduces LobRA's own ranking of candidates, and the window is priced where
    deployments are judged (their dispatched micro-batches, ``dispatch.placed_work``).
    """
    m = cost_model.max_tokens(config)
    latency = float(cost_model.microbatch_time(config, 1, m)) * (LOBRA_PROFILE_MICROBATCHES + config.pp - 1)
    return LOBRA_PROFILE_MICROBATCHES * m / (latency * config.n_gpus)


def make_candidate(cost_model: CostModel, config: ParallelConfig) -> Candidate:
    return Candidate(
        config=config, max_tokens=cost_model.max_tokens(config), throughput=lobra_throughput(cost_model, config)
    )


def gpu_budget_rows(
    configs: Sequence[ParallelConfig], cluster: ClusterSpec, sequences: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The GPU budget as linear rows ``A @ p <= cap`` over the replica counts p_i of ``configs``: a budget
    per pool, a replica on its config's pool; and, given the ``sequences`` S a step has, at most S replicas.

    A TP group stays inside one node of its pool and every group of a config with tp_i >= t takes a
    multiple of t GPUs, so for every pool and every threshold t among the TP degrees of its configs those
    groups fit in at most ``nodes * t * floor(G / t)`` GPUs (G: the pool's GPUs per node). With
    power-of-two TP degrees the sizes divide each other and these rows are also sufficient: first-fit
    decreasing places every group (:func:`lorafleet.planner.placement.place_replicas`). For t = 1 the
    row is Σ_{i on the pool} N_i p_i <= N_pool.

    A replica with no sequence is idle: it adds GPUs and no speed, so no plan the objective prefers has more
    replicas than a step has sequences. The last row, Σ_i p_i <= S, says so when the GPUs alone allow more
    than S replicas (:func:`most_replicas`); it bounds the planning of a huge fleet by the workload (two tasks
    of 2 sequences on 524,288 GPUs: at most 4 replicas, not 262,144 of each config), and is absent, so the
    problem is unchanged, wherever the GPUs bind first.
    """
    rows, caps = [], []
    for pool in cluster.pools:
        on = np.array([c.pool == pool.name for c in configs], dtype=bool)
        tps = np.array([c.tp for c in configs], dtype=np.int64)
        gpus = np.array([c.n_gpus for c in configs], dtype=np.int64)
        for t in sorted({1, *tps[on].tolist()}):
            rows.append(np.where(on & (tps >= t), gpus, 0))
            caps.append(pool.nodes * t * (pool.gpus_per_node // t))
    if sequences is not None and most_replicas(configs, cluster) > sequences:
        rows.append(np.ones(len(configs), dtype=np.int64))
        caps.append(sequences)
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(configs)), np.array(caps, dtype=np.int64)


def most_replicas(configs: Sequence[ParallelConfig], cluster: ClusterSpec) -> int:
    """An upper bound on the replicas the GPUs hold: Σ over pools of its GPUs / the fewest GPUs a config of it
    takes."""
    return sum(
        pool.n_gpus // min(c.n_gpus for c in configs if c.pool == pool.name)
        for pool in cluster.pools
        if any(c.pool == pool.name for c in configs)
    )


def max_replicas(configs: Sequence[ParallelConfig], cluster: ClusterSpec, sequences: int | None = None) -> np.ndarray:
    """P_i: the most replicas of each config the GPU budget allows on its own (and at most ``sequences``),
    shape (C,)."""
    rows, caps = gpu_budget_rows(configs, cluster, sequences)
    per_row = np.where(rows > 0, caps[:, None] // np.maximum(rows, 1), np.iinfo(np.int64).max)
    return per_row.min(axis=0)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PlanningProblem:
    """Everything the deployment optimisation needs; times in seconds."""

    candidates: tuple[Candidate, ...]
    """Configs i, sorted by (M, config): the order of the dispatcher's config classes."""
    cluster: ClusterSpec
    """The GPUs the plan may use: nodes x gpus_per_node."""
    load: LoadModel
    """α_ij, β_ij, b_ij, o_i and D_j of every candidate on the planning buckets (one class
    each, no replicas yet): the coefficients of the MILP, the MINLP and the heuristic."""
    batch: GlobalBatch
    """The expected global batch."""
    cost_model: CostModel
    policy: DispatchPolicy
    """How steps will be dispatched (bucket count, padding or packing, pipeline window): deployments are
    judged by it, and the plan records it."""

    @property
    def n_gpus(self) -> int:
        return self.cluster.n_gpus

    @property
    def usable_gpus(self) -> int:
        """The most GPUs a deployment the budget allows can hold: N, or fewer when a step's S sequences
        bind before the GPUs do (:func:`gpu_budget_rows`), S replicas of the largest config."""
        if most_replicas(self.configs, self.cluster) <= len(self.batch):
            return self.n_gpus
        return min(self.n_gpus, len(self.batch) * int(self.gpus.max()))

    @property
    def configs(self) -> tuple[ParallelConfig, ...]:
        return tuple(c.config for c in self.candidates)

    @property
    def counts(self) -> np.ndarray:
        """D_j, shape (R,)."""
        return self.load.counts

    @property
    def boundaries(self) -> np.ndarray:
        """s_j, shape (R,)."""
        return self.load.boundaries

    @property
    def microbatch_size(self) -> np.ndarray:
        """b_ij, shape (C, R); 0 where config i cannot hold bucket j."""
        return self.load.microbatch_rows

    @property
    def full_time(self) -> np.ndarray:
        """t(b_ij, s_j) = α_ij b_ij + β_ij: a full micro-batch's stage time, shape (C, R); 0 where b_ij = 0."""
        b = self.microbatch_size
        return np.where(b > 0, self.load.per_seq_s * b + self.load.per_microbatch_s, 0.0)

    @property
    def amortised_time(self) -> np.ndarray:
        """w_ij = t(b_ij, s_j) / b_ij: seconds per sequence in full micro-batches (inf where ineligible)."""
        b = self.microbatch_size
        return np.where(b > 0, self.full_time / np.maximum(b, 1), np.inf)

    @property
    def gpus(self) -> np.ndarray:
        """N_i, shape (C,)."""
        return np.array([c.n_gpus for c in self.candidates], dtype=np.int64)

    @property
    def replica_prices(self) -> np.ndarray | None:
        """c_i = price(pool of i) * N_i / 3600: what one replica of config i costs a second at its pool's price,
        shape (C,); None when a pool has no price."""
        if not self.cluster.priced:
            return None
        prices = [self.cluster.pool(c.config.pool).price_per_gpu_hour or 0.0 for c in self.candidates]
        return np.asarray(prices, dtype=float) * self.gpus / SECONDS_PER_HOUR

    def gpu_budget_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The GPU budget as rows ``A @ p <= cap`` over replica counts p_i, at most one replica per sequence of
        the batch (see :func:`gpu_budget_rows`)."""
        return gpu_budget_rows(self.configs, self.cluster, len(self.batch))

    def max_replicas(self) -> np.ndarray:
        """P_i: the most replicas of config i the GPU budget allows on its own, shape (C,)."""
        return max_replicas(self.configs, self.cluster, len(self.batch))

    def fits(self, replicas: np.ndarray) -> bool:
        """Whether replica counts p (shape (C,)) respect the GPU budget, node boundaries included."""
        rows, caps = self.gpu_budget_rows()
        return bool(np.all(rows @ np.asarray(replicas, dtype=np.int64) <= caps))

    def covers(self, replicas: np.ndarray) -> bool:
        """Whether the deployed configs hold the longest sequence of the expected batch (memory)."""
        deployed = [c.max_tokens for c, p in zip(self.candidates, replicas, strict=True) if p > 0]
        return bool(deployed) and max(deployed) >= int(self.batch.lengths.max())

    def plan_classes(self, replicas: np.ndarray) -> tuple[ConfigClass, ...]:
        """The dispatcher's config classes of deployment p: one per deployed config, its p_i
        replicas numbered consecutively in candidate order (the order the plan places them in)."""
        classes, start = [], 0
        for cand, p in zip(self.candidates, np.asarray(replicas, dtype=np.int64), strict=True):
            if p > 0:
                classes.append(
                    ConfigClass(
                        config=cand.config, max_tokens=cand.max_tokens, replicas=tuple(range(start, start + int(p)))
                    )
                )
                start += int(p)
        return tuple(classes)

    def restricted(self, keep: Sequence[int]) -> PlanningProblem:
        """The same planning question over candidates ``keep`` only (their own planning buckets)."""
        return build_problem(self.batch, [self.candidates[i] for i in keep], self.cost_model, self.cluster, self.policy)

    def plan_view(self, replicas: np.ndarray, length_based: bool = True) -> tuple[LoadModel, Assignment | None]:
        """Deployment p as its steps will see the expected batch: the dispatcher's buckets for the
        deployed configs' M (its DP, ``policy.options.n_buckets``), their load model, and LobRA's
        length-based dispatch on them (None unless ``length_based``: it serves the Theorem-1 filter only)."""
        options = replace(self.policy.options, method=DispatchMethod.LENGTH, choose_buckets_by_makespan=False)
        classes = self.plan_classes(replicas)
        if not length_based:
            return bucket_load(self.batch, classes, self.cost_model, options)[1], None
        _, load, assignment = choose_buckets(self.batch, classes, self.cost_model, options)
        return load, assignment


def build_problem(
    batch: GlobalBatch,
    candidates: Sequence[Candidate],
    cost_model: CostModel,
    cluster: ClusterSpec,
    policy: DispatchPolicy,
) -> PlanningProblem:
    """Bucket the expected batch for the whole candidate set and tabulate every candidate on the buckets.

    The planning buckets are the dispatcher's padding-minimising DP with a barrier at every
    candidate's M (no bucket straddles a memory limit, so each is held by a config entirely
    or not at all) and ``policy.options.n_buckets`` buckets on top of the one per memory segment
    present, so that many barriers do not leave the buckets coarse.
    """
    dispatch = policy.options
    ordered = tuple(sorted(candidates, key=lambda c: (c.max_tokens, c.config)))
    barriers = sorted({c.max_tokens for c in ordered})
    lengths = batch.lengths
    present = np.unique(np.searchsorted(barriers, lengths, side="left")).size
    bucketing = optimal_buckets(
        lengths, dispatch.n_buckets + present, alignment=dispatch.bucket_alignment, barriers=barriers
    )
    boundaries = np.array(bucketing.boundaries, dtype=np.int64)
    classes = tuple(ConfigClass(config=c.config, max_tokens=c.max_tokens, replicas=()) for c in ordered)
    load = build_load_model(
        classes,
        cost_model,
        boundaries,
        lengths,
        bucket_of(lengths, boundaries),
        dispatch.microbatch_mode,
    )
    return PlanningProblem(
        candidates=ordered, cluster=cluster, load=load, batch=batch, cost_model=cost_model, policy=policy
    )
