"""The load model both balancers optimise: a config's step time from its bucket counts.

Replicas with the same config and max tokens form a *config class* i with p_i replicas;
they share the class's load evenly, so the slowest of them holds n_ij = ceil(d_ij / p_i)
of the d_ij sequences of bucket j given to the class (LobRA's aggregation: no variable per
replica, hence no symmetry between identical replicas).

The LobRA time of a micro-batch is linear in its row count b (Eq. 10):
t(b, s) = alpha(s) * b + beta(s), with alpha(s) = c1 s^2 + c3 s + c5 and
beta(s) = c2 s^2 + c4 s + c6 per layer (times L / pp for a stage). A replica cuts its n_j
sequences of bucket j into ceil(n_j / b_j) micro-batches of at most b_j = floor(M / s_j)
rows, so its pipelined time is exactly::

    T_i = o_i + sum_j [ alpha_ij * n_ij + beta_ij * ceil(n_ij / b_ij) ]
              + bubble_i * max_{j: n_ij > 0} ( alpha_ij * min(n_ij, b_ij) + beta_ij )

with o_i the per-step overhead (charged even to an idle class: an upper bound) and bubble_i
``pp_i - 1`` (LobRA Eq. 12, ``CostModel.drained_bubble_slots``), whatever the pipeline window:
what a window saves depends on how many micro-batches of how many tasks each replica gets
(``costmodel.schedule``), which is what balancing decides. Charging the drain keeps the balance
from loading a pipelined replica for a stream its step turns out not to have (a replica given a
few long sequences of two tasks stalls as much as it drains); every dispatched step is then
priced with its own micro-batches and tasks (``CostModel.replica_time``), which is where the
window's saving shows, in the dispatcher's estimate, the planner's judgement and the simulator. alpha and
beta are read off the cost model: alpha = t(2, s) - t(1, s), beta = 2 t(1, s) - t(2, s). In
packing mode alpha_ij is the mean per-sequence time of
the bucket's actual lengths plus its share of the per-micro-batch constant at the boundary,
beta_bound * mean length / M (micro-batches are packed to M tokens across buckets, so a
bucket does not cost a micro-batch of its own), beta_ij = 0, and b_ij = floor(M / mean
length): an estimate of how densely the bucket packs. It is only an estimate of the packed
step: the packer (first-fit decreasing) pays each micro-batch's whole constant at its longest
sequence and may leave micro-batches part-empty, and a packed micro-batch mixes buckets, so
its pipeline bubble is not one bucket's. The dispatcher's estimate of a step (and the
planner's judgement of a deployment) prices the packed micro-batches themselves
(:func:`lorafleet.dispatch.step.placed_work`); the balancers need this separable form.

Beside it the model keeps rates that *bound* every dispatch from below (``bound_*``, used by
:func:`lorafleet.dispatch.balance.fluid_bound`), whatever the micro-batches: with
non-negative cost coefficients a replica holding sequences Q of bucket j takes at least
u_ij |Q| + v_ij Σ_{q in Q} l_q of compute. Padding: u = alpha + beta / b, v = 0
(ceil(n / b) >= n / b). Packing: a micro-batch of at most M tokens pays its constant
beta(max l) >= Σ_q (l_q / M) beta(l_q) (beta grows with the length), so a sequence costs at
least r(l) = t(2, l) - t(1, l) + l beta(l) / M, a convex function of l; (u, v) is its
tangent at the bucket's mean length, below r at every length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MS_PER_S
from lorafleet.dispatch.sorting import lexsort_ints
from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.dispatch import MicroBatchMode
from lorafleet.work import by_identity
from lorafleet.work import memo as work_memo

SPEED_TOLERANCE = 0.05
"""Replicas of one config whose speed factors lie within this fraction above the least factor of
their class share it, priced at the members' mean factor (``config_classes``)."""


@dataclass(frozen=True)
class ConfigClass:
    """Replicas of one config and one max tokens M (and, once recalibrated, about one speed); they share
    their load evenly."""

    config: ParallelConfig
    max_tokens: int
    replicas: tuple[int, ...]
    """Positions of the class's replicas in ``DeploymentPlan.replicas``."""
    time_scale: float = 1.0
    """Every time of the cost model is multiplied by this for the class (online recalibration: a
    replica measured 2x slower than modelled has 2.0; ``dispatch.recalibration``)."""


def config_classes(
    plan: DeploymentPlan, cost_model: CostModel, speed: Sequence[float] | None = None
) -> tuple[ConfigClass, ...]:
    """The plan's replicas grouped by (config, M), ordered by (M, config); checked against the cost model.

    With ``speed`` (a time factor per replica, in plan order), a group is further split where the
    factors, in increasing order, rise more than ``SPEED_TOLERANCE`` above the class's first: each
    class is priced at its members' mean factor, so measurement noise keeps identical replicas
    together while a straggler gets a class, and a share, of its own.
    """
    if not plan.replicas:
        raise InputError("<plan>", "replicas", "the deployment plan has no replicas")
    if speed is not None and len(speed) != len(plan.replicas):
        raise ValueError(f"{len(speed)} speed factors for {len(plan.replicas)} replicas")
    groups: dict[tuple[int, ParallelConfig], list[int]] = {}
    for pos, replica in enumerate(plan.replicas):
        if not cost_model.times(replica.config):
            raise InputError(
                "<cost model>",
                f"layer_time[tp={replica.config.tp}]",
                f"no time model for replica {replica.replica_id} ({replica.config})",
            )
        if replica.max_tokens < 1:
            raise InputError("<plan>", f"replicas[{pos}].max_tokens", f"must be >= 1, got {replica.max_tokens}")
        groups.setdefault((replica.max_tokens, replica.config), []).append(pos)
    classes = []
    for (m, c), members in sorted(groups.items()):
        if speed is None:
            classes.append(ConfigClass(config=c, max_tokens=m, replicas=tuple(members)))
            continue
        ordered = sorted(members, key=lambda pos: (speed[pos], pos))
        runs: list[list[int]] = []
        for pos in ordered:
            if runs and speed[pos] <= speed[runs[-1][0]] * (1 + SPEED_TOLERANCE):
                runs[-1].append(pos)
            else:
                runs.append([pos])
        classes += [
            ConfigClass(
                config=c,
                max_tokens=m,
                replicas=tuple(sorted(run)),
                time_scale=float(np.mean([speed[pos] for pos in run])),
            )
            for run in runs
        ]
    return tuple(classes)


@dataclass(frozen=True)
class LoadModel:
    """Everything the balancers need for one step: classes x buckets arrays, times in seconds."""

    classes: tuple[ConfigClass, ...]
    boundaries: np.ndarray
    """(R,) bucket boundaries s_j, ascending."""
    counts: np.ndarray
    """(R,) D_j: the step's sequences per bucket."""
    per_seq_s: np.ndarray
    """(K, R) alpha_ij: stage seconds one more row costs."""
    per_microbatch_s: np.ndarray
    """(K, R) beta_ij: stage seconds one more micro-batch costs."""
    microbatch_rows: np.ndarray
    """(K, R) b_ij: rows per full micro-batch; 0 where the bucket does not fit the class (s_j > M_i)."""
    overhead_s: np.ndarray
    """(K,) o_i: per-step fixed seconds of a replica."""
    n_replicas: np.ndarray
    """(K,) p_i: replicas of each class."""
    pp: np.ndarray
    """(K,) pipeline stages of each class."""
    bubble_slots: np.ndarray
    """(K,) the pipeline bubble of each class in multiples of its largest micro-batch time
    (``CostModel.bubble_slots`` without task structure); 0 without a pipeline."""
    compute_table: np.ndarray
    """(K, sum_j (D_j + 1)) alpha n + beta ceil(n / b) of n = 0..D_j rows of bucket j, from ``table_start[j]``."""
    largest_table: np.ndarray
    """(K, sum_j (D_j + 1)) the largest micro-batch time of n rows of bucket j (0 for n = 0)."""
    table_start: np.ndarray
    """(R,) where bucket j's entries start in the tables."""
    bound_per_seq_s: np.ndarray
    """(K, R) u_ij: with ``bound_per_token_s``, the compute of sequences of bucket j on class i is at
    least u_ij n + v_ij (their tokens) (module docstring)."""
    bound_per_token_s: np.ndarray
    """(K, R) v_ij (0 in padding mode)."""
    tokens: np.ndarray
    """(R,) Y_j: the step's tokens per bucket."""
    length_range: np.ndarray
    """(R, 2) the shortest and longest length of each bucket (the boundary for an empty one)."""

    @property
    def feasible(self) -> np.ndarray:
        """(K, R) whether class i may take bucket j."""
        return self.microbatch_rows > 0

    def row_cost(self, i: int | np.ndarray, bucket: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Compute time and largest micro-batch time of ``rows`` rows of ``bucket`` on one replica of class i.

        Looked up in the tables when every count is within the step's D_j (the balancers'
        inner loops); computed in closed form otherwise (callers with their own counts).
        """
        rows = np.asarray(rows)
        if np.any(rows > self.counts[bucket]):
            return _row_cost(
                self.per_seq_s[i, bucket],
                self.per_microbatch_s[i, bucket],
                np.maximum(self.microbatch_rows[i, bucket], 1),
                rows,
            )
        return self.table_cost(i, bucket, rows)

    def table_cost(self, i: int | np.ndarray, bucket: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`row_cost` of counts known to be within 0..D_j (the balancers' inner loops), from the tables."""
        at = self.table_start[bucket] + rows + np.asarray(i) * self.compute_table.shape[1]  # flat: one take, not a pair
        return self.compute_table.ravel().take(at), self.largest_table.ravel().take(at)

    def replica_load(self, i: int, rows: np.ndarray) -> np.ndarray:
        """T of one replica of class i holding ``rows`` (..., R) sequences per bucket (see module docstring)."""
        rows = np.asarray(rows)
        compute, largest = self.row_cost(i, np.arange(rows.shape[-1]), rows)
        return self.overhead_s[i] + compute.sum(axis=-1) + self.bubble_slots[i] * largest.max(axis=-1, initial=0.0)

    def times(self, d: np.ndarray, classes: np.ndarray | None = None) -> np.ndarray:
        """(K,) modelled time of each class's slowest replica for class totals ``d`` (K, R); with
        ``classes`` (n,), of those classes, ``d`` (n, R) holding their totals."""
        i = np.arange(len(self.classes)) if classes is None else np.asarray(classes)
        rows = -(-np.asarray(d) // self.n_replicas[i, None])
        compute, largest = self.row_cost(i[:, None], np.arange(rows.shape[1]), rows)
        return self.overhead_s[i] + compute.sum(axis=1) + self.bubble_slots[i] * largest.max(axis=1, initial=0.0)

    def makespan(self, d: np.ndarray) -> float:
        return float(self.times(d).max())


def build_load_model(
    classes: tuple[ConfigClass, ...],
    cost_model: CostModel,
    boundaries: np.ndarray,
    lengths: np.ndarray,
    bucket: np.ndarray,
    mode: MicroBatchMode,
) -> LoadModel:
    """The load model of one step: ``lengths[q]`` falls in bucket ``bucket[q]`` of ``boundaries``."""
    s = np.asarray(boundaries, dtype=np.int64)
    memo = work_memo("load rows")
    if memo is None:
        step = _Step(s, lengths, bucket, *_bucket_stats(s, lengths, bucket, mode))
    else:
        batch = (mode, s.tobytes(), lengths.dtype.str, lengths.tobytes(), bucket.dtype.str, bucket.tobytes())
        if batch not in memo:
            memo[batch] = _bucket_stats(s, lengths, bucket, mode)
        step = _Step(s, lengths, bucket, *memo[batch])
    shape = (len(classes), s.size)
    per_seq, per_mb, bound_seq, bound_token = np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
    rows = np.zeros(shape, dtype=np.int64)
    for i, cls in enumerate(classes):
        if memo is None:
            row = _class_rows(cost_model, cls, step)
        else:
            key = (cls.config, cls.max_tokens, cls.time_scale, batch)
            row = by_identity(memo, cost_model, key, lambda cls=cls: _class_rows(cost_model, cls, step))
        per_seq[i], per_mb[i], rows[i], bound_seq[i], bound_token[i] = row
    deployed = cost_model.spanning(c.config.pool for c in classes)  # the sync crosses pools iff the classes do
    overhead = np.array([c.time_scale * deployed.step_overhead(c.config) for c in classes])
    compute_table, largest_table, table_start = _cost_tables(per_seq, per_mb, rows, step.counts)
    return LoadModel(
        classes=classes,
        boundaries=s,
        counts=step.counts.copy(),
        per_seq_s=per_seq,
        per_microbatch_s=per_mb,
        microbatch_rows=rows,
        overhead_s=overhead,
        n_replicas=np.array([len(c.replicas) for c in classes], dtype=np.int64),
        pp=np.array([c.config.pp for c in classes], dtype=np.int64),
        bubble_slots=np.array([cost_model.drained_bubble_slots(c.config) for c in classes], dtype=float),
        compute_table=compute_table,
        largest_table=largest_table,
        table_start=table_start,
        bound_per_seq_s=bound_seq,
        bound_per_token_s=bound_token,
        tokens=step.tokens.copy(),
        length_range=step.length_range.copy(),
    )


@dataclass(frozen=True)
class _Step:
    """One step's buckets as a load model reads them, whatever the classes: the boundaries s_j, the lengths and
    their buckets, D_j, Y_j, each bucket's shortest and longest length (its boundary when empty), and in packing
    mode its mean length (its boundary when empty; None: padding mode)."""

    boundaries: np.ndarray
    lengths: np.ndarray
    bucket: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray
    length_range: np.ndarray
    mean_len: np.ndarray | None


def _bucket_stats(
    s: np.ndarray, lengths: np.ndarray, bucket: np.ndarray, mode: MicroBatchMode
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """:class:`_Step`'s D_j, Y_j, length ranges and mean lengths of ``lengths`` in buckets ``bucket`` of ``s``."""
    counts = np.bincount(bucket, minlength=s.size).astype(np.int64)
    tokens = np.bincount(bucket, weights=lengths, minlength=s.size)
    length_range = np.stack([s, s], axis=1).astype(float)
    present = np.flatnonzero(counts)
    order = lexsort_ints((lengths,))  # by (bucket, length): a bucket's lengths are a range of lengths
    starts = np.concatenate(([0], np.cumsum(counts)))
    length_range[present, 0] = lengths[order][starts[present]]
    length_range[present, 1] = lengths[order][starts[present + 1] - 1]
    packed = mode is MicroBatchMode.PACKING
    return counts, tokens, length_range, np.where(counts > 0, tokens / np.maximum(counts, 1), s) if packed else None


def _class_rows(cost_model: CostModel, cls: ConfigClass, step: _Step) -> tuple[np.ndarray, ...]:
    """Class ``cls``'s rows of the load model (module docstring), each (R,): alpha_ij, beta_ij, b_ij, u_ij, v_ij.
    A function of the class's config, M and time scale, the cost model and the step alone, not of the other
    classes, nor of p_i: a counted scope (a plan, whose deployments share most classes and are judged on one
    expected batch) keeps them in its memo (``build_load_model``)."""
    s, counts, n_buckets = step.boundaries, step.counts, step.boundaries.size
    fits = s <= cls.max_tokens
    scale = cls.time_scale
    one = scale * np.asarray(cost_model.microbatch_time(cls.config, 1, s), dtype=float)
    two = scale * np.asarray(cost_model.microbatch_time(cls.config, 2, s), dtype=float)
    mean_len = step.mean_len
    if mean_len is None:
        per_seq = two - one
        per_mb = 2 * one - two
        rows = np.where(fits, cls.max_tokens // s, 0)
        return per_seq, per_mb, rows, per_seq + per_mb / np.maximum(rows, 1), np.zeros(n_buckets)
    seq_time = scale * (
        np.asarray(cost_model.microbatch_time(cls.config, 2, step.lengths), dtype=float)
        - np.asarray(cost_model.microbatch_time(cls.config, 1, step.lengths), dtype=float)
    )
    per_seq = np.where(
        counts > 0,
        np.bincount(step.bucket, weights=seq_time, minlength=n_buckets) / np.maximum(counts, 1),
        two - one,
    )
    # A packed micro-batch fills up to M tokens from every bucket, so each sequence pays
    # its token share of one micro-batch's constant, not a micro-batch per bucket. That
    # constant is beta = 2 t(1, s) - t(2, s): a lone sequence packed costs t(1, s) (time_model).
    per_seq += (2 * one - two) * mean_len / cls.max_tokens
    rows = np.where(fits, np.maximum(cls.max_tokens // np.maximum(mean_len, 1).astype(np.int64), 1), 0)
    u, v = _packed_tangent(cost_model, cls, mean_len)  # at the bucket's mean length
    return per_seq, np.zeros(n_buckets), rows, scale * u, scale * v


def _bound_coeffs(cost_model: CostModel, config: ParallelConfig) -> np.ndarray | None:
    """The stage's LobRA coefficients c1..c6 in seconds (a windowed model's attention at its global layers' share,
    ``LayerTimeCoeffs.global_floor``: still a bound), or None when one is negative (r need not be convex)."""
    c = np.asarray(cost_model.stage_coeffs(config).global_floor().c, dtype=float) / MS_PER_S
    return None if c.min() < 0 else c


def sequence_lower_bound(
    cost_model: CostModel, config: ParallelConfig, max_tokens: int, lengths: np.ndarray
) -> np.ndarray:
    """r(l) = c1 l^2 + c3 l + c5 + l (c2 l^2 + c4 l + c6) / M, seconds: the least stage time a sequence of
    length l adds to a replica of ``config``, padded or packed (module docstring); +inf where l > M,
    0 everywhere for a cost model with a negative coefficient (then nothing is bounded)."""
    lengths = np.asarray(lengths, dtype=float)
    c = _bound_coeffs(cost_model, config)
    if c is None:
        return np.zeros_like(lengths)
    c1, c2, c3, c4, c5, c6 = c
    r = c1 * lengths**2 + c3 * lengths + c5 + lengths * (c2 * lengths**2 + c4 * lengths + c6) / max_tokens
    return np.where(lengths <= max_tokens, r, np.inf)


def _packed_tangent(cost_model: CostModel, cls: ConfigClass, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u, v) with u + v l the tangent at length m of a packed sequence's least cost r(l)
    (:func:`sequence_lower_bound`), seconds; (0, 0), which bounds nothing, for a cost model with a
    negative coefficient (r need not be convex)."""
    c = _bound_coeffs(cost_model, cls.config)
    if c is None:
        return np.zeros_like(m, dtype=float), np.zeros_like(m, dtype=float)
    c1, c2, c3, c4, c5, c6 = c
    M = cls.max_tokens
    value = c1 * m**2 + c3 * m + c5 + m * (c2 * m**2 + c4 * m + c6) / M
    slope = 2 * c1 * m + c3 + (3 * c2 * m**2 + 2 * c4 * m + c6) / M
    return value - slope * m, slope


def _cost_tables(
    per_seq: np.ndarray, per_mb: np.ndarray, rows: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """alpha n + beta ceil(n / b) and alpha min(n, b) + beta for n = 0..D_j, every class, buckets laid end to end."""
    width = counts + 1
    table_start = np.concatenate(([0], np.cumsum(width)[:-1])).astype(np.int64)
    n = np.arange(int(width.sum())) - np.repeat(table_start[: width.size], width)  # no bucket: [0] and nothing
    # each bucket's coefficients repeated over its entries (a repeat, not a gather: ~16 buckets, ~15,000 entries)
    spread = (np.repeat(x, width, axis=1) for x in (per_seq, per_mb, np.maximum(rows, 1)))
    compute, largest = _row_cost(*spread, n)
    return compute, largest, table_start


def _row_cost(alpha: np.ndarray, beta: np.ndarray, b: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """alpha n + beta ceil(n / b), and the largest micro-batch alpha min(n, b) + beta (0 for n = 0).

    In floats: the quotient of two integers below 2**53, correctly rounded, is never rounded across an
    integer, so its ceiling is the integer ceiling (and every product the one of the integers)."""
    n = np.asarray(n, dtype=float)
    # in place on the two fresh arrays (alpha, beta and b index alike, so n / b has every operand's shape), each
    # product and sum as written (IEEE's are commutative): 0.8x of the expression's time on a plan's tables
    compute = n / b
    np.ceil(compute, out=compute)
    compute *= beta
    compute += alpha * n
    largest = np.minimum(n, b)
    largest *= alpha
    largest += beta
    np.copyto(largest, 0.0, where=n == 0)
    return compute, largest
