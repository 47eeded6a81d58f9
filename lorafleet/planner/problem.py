"""The planning problem as arrays: planning buckets j x candidate configs i.

Notation (LobRA, Sec. 4 and Appendix D): bucket j holds D_j sequences of the expected
global batch padded to its upper length s_j; config i = ⟨tp_i, pp_i⟩ uses N_i = tp_i pp_i
GPUs and holds micro-batches of at most M_i tokens, so a full micro-batch of bucket j has
b_ij = floor(M_i / s_j) rows (0: config i cannot hold bucket j). A micro-batch of b rows
takes the stage time t(b, s_j) = α_ij b + β_ij (Eq. 10 is affine in b), and a replica given
n_ij rows of each bucket takes (Eq. 12, 1F1B, plus the step overhead o_i)::

    T_i = o_i + Σ_j [ α_ij n_ij + β_ij ceil(n_ij / b_ij) ] + (pp_i - 1) max_{j: n_ij > 0} t(min(n_ij, b_ij), s_j)

That closed form, and the balancers that minimise the slowest T_i for a fixed deployment,
belong to the dispatcher (:mod:`lorafleet.dispatch.load`); the planner reuses them, so a
plan is judged by the very model its steps will be dispatched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.dispatch.bucketing import bucket_of, optimal_buckets
from lorafleet.dispatch.load import ConfigClass, LoadModel, build_load_model
from lorafleet.dispatch.options import MicroBatchMode
from lorafleet.specs.cluster import ClusterSpec

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
    """
    m = cost_model.max_tokens(config)
    latency = float(cost_model.microbatch_time(config, 1, m)) * (LOBRA_PROFILE_MICROBATCHES + config.pp - 1)
    return LOBRA_PROFILE_MICROBATCHES * m / (latency * config.n_gpus)


def make_candidate(cost_model: CostModel, config: ParallelConfig) -> Candidate:
    return Candidate(config=config, max_tokens=cost_model.max_tokens(config), throughput=lobra_throughput(cost_model, config))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PlanningProblem:
    """Everything the deployment optimisation needs; times in seconds."""

    candidates: tuple[Candidate, ...]
    """Configs i, sorted by (M, config): the order of the dispatcher's config classes."""
    cluster: ClusterSpec
    """The GPUs the plan may use: nodes x gpus_per_node."""
    load: LoadModel
    """α_ij, β_ij, b_ij, o_i and D_j of every candidate (one class each, no replicas yet)."""
    cost_model: CostModel
    lengths: np.ndarray
    """The expected batch's sequence lengths."""
    bucket: np.ndarray
    """Each sequence's planning bucket."""

    @property
    def tokens(self) -> np.ndarray:
        """Real (unpadded) tokens of each bucket in the expected batch, shape (R,)."""
        return np.bincount(self.bucket, weights=self.lengths, minlength=self.boundaries.size)

    @property
    def n_gpus(self) -> int:
        return self.cluster.n_gpus

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
    def pp(self) -> np.ndarray:
        return self.load.pp

    def gpu_budget_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The GPU budget as linear rows ``A @ p <= cap`` over replica counts p_i.

        A TP group stays inside one node and every group of a config with tp_i >= t takes a
        multiple of t GPUs, so for every threshold t among the TP degrees those groups fit in
        at most ``nodes * t * floor(G / t)`` GPUs (G GPUs per node). With power-of-two TP
        degrees the sizes divide each other and these rows are also sufficient: first-fit
        decreasing places every group (:func:`lorafleet.planner.placement.place_replicas`).
        For t = 1 the row is Σ_i N_i p_i <= N.
        """
        tps = np.array([c.config.tp for c in self.candidates], dtype=np.int64)
        thresholds = sorted({1, *tps.tolist()})
        per_node = self.cluster.gpus_per_node
        rows = np.array([np.where(tps >= t, self.gpus, 0) for t in thresholds], dtype=np.int64)
        caps = np.array([self.cluster.nodes * t * (per_node // t) for t in thresholds], dtype=np.int64)
        return rows, caps

    def max_replicas(self) -> np.ndarray:
        """P_i: the most replicas of config i the GPU budget allows on its own, shape (C,)."""
        rows, caps = self.gpu_budget_rows()
        per_row = np.where(rows > 0, caps[:, None] // np.maximum(rows, 1), np.iinfo(np.int64).max)
        return per_row.min(axis=0)

    def fits(self, replicas: np.ndarray) -> bool:
        """Whether replica counts p (shape (C,)) respect the GPU budget, node boundaries included."""
        rows, caps = self.gpu_budget_rows()
        return bool(np.all(rows @ np.asarray(replicas, dtype=np.int64) <= caps))

    def covers(self, replicas: np.ndarray) -> bool:
        """Whether the deployed configs hold every non-empty bucket between them (memory)."""
        deployed = np.asarray(replicas) > 0
        return bool(np.all(self.microbatch_size[deployed].max(axis=0, initial=0)[self.counts > 0] > 0))

    def plan_load(self, replicas: np.ndarray) -> LoadModel:
        """The dispatcher's load model of deployment p: one class per deployed config, its p_i
        replicas numbered consecutively in candidate order (the order :func:`place_replicas` uses)."""
        replicas = np.asarray(replicas, dtype=np.int64)
        classes, start = [], 0
        for i in np.flatnonzero(replicas > 0):
            cand = self.candidates[i]
            classes.append(ConfigClass(config=cand.config, max_tokens=cand.max_tokens, replicas=tuple(range(start, start + int(replicas[i])))))
            start += int(replicas[i])
        return build_load_model(tuple(classes), self.cost_model, self.boundaries, self.lengths, self.bucket, MicroBatchMode.PADDING)


def build_problem(
    lengths: np.ndarray,
    candidates: Sequence[Candidate],
    cost_model: CostModel,
    cluster: ClusterSpec,
    n_buckets: int,
    *,
    barriers: Sequence[int] | None = None,
    alignment: int = 16,
) -> PlanningProblem:
    """Bucket the expected batch ``lengths`` and tabulate every candidate on the buckets.

    The buckets are the dispatcher's padding-minimising DP with at most ``n_buckets``
    buckets (raised to the number of memory classes present), with ``barriers`` (default:
    every candidate's M) that no bucket straddles, so each bucket fits a config entirely or
    not at all.
    """
    ordered = tuple(sorted(candidates, key=lambda c: (c.max_tokens, c.config)))
    barriers = sorted({c.max_tokens for c in ordered} if barriers is None else set(barriers))
    present = np.unique(np.searchsorted(barriers, lengths, side="left")).size
    bucketing = optimal_buckets(lengths, max(n_buckets, present), alignment=alignment, barriers=barriers)
    boundaries = np.array(bucketing.boundaries, dtype=np.int64)
    bucket = bucket_of(lengths, boundaries)
    classes = tuple(ConfigClass(config=c.config, max_tokens=c.max_tokens, replicas=()) for c in ordered)
    load = build_load_model(classes, cost_model, boundaries, lengths, bucket, MicroBatchMode.PADDING)
    return PlanningProblem(candidates=ordered, cluster=cluster, load=load, cost_model=cost_model,
                           lengths=np.asarray(lengths, dtype=np.int64), bucket=bucket)
