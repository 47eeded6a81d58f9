"""The homogeneous baselines, on the same cost model and data, each a replayable :class:`Schedule`.

- **Task-Fused padding** (LobRA's baseline): all tasks on the best single homogeneous
  config (as many replicas as fit, at most one per sequence of a step: more would be idle), every
  sequence padded to LobRA's static power-of-two buckets 256, 512, ..., 2^ceil(log2 longest).
- **Task-Fused packing** (the baseline LobRA's reviewers asked for): the best homogeneous
  config with sequences packed end to end up to M tokens per micro-batch.
- **Task-Sequential**: each task alone on its own best homogeneous config, padded as in
  Task-Fused, the tasks one after another on the whole cluster; a step costs the sum of
  the tasks' makespans and GPU-seconds add up.

"Best" is the config with the fewest expected GPU-seconds (makespan x GPUs) on the
expected batch, each config judged as lorafleet's plans are: the dispatcher's estimate of
the step under the baseline's own policy (a homogeneous deployment needs no balancing: the
batch placed on the replicas, cut into micro-batches, priced); the chosen baseline is then
costed by the real dispatcher like lorafleet's plan.

On a fleet of several pools a baseline's one config is one layout ⟨tp, pp⟩ that runs on every
pool, as many replicas of it as fit in each (every GPU kind's replicas holding their own M):
:func:`best_across_pools`. Its replicas differ in speed, so each layout is judged by the real
dispatcher's estimate of its step (``dispatch_step``, which balances by each replica's own time
model), and the best is the one of fewest GPU-seconds, or fewest currency units per step when
every pool has a price.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import numpy as np

from lorafleet.accounting import price_per_second
from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.dispatch import (
    ConfigClass,
    DispatchOptions,
    DispatchPolicy,
    MicroBatchMode,
    bucket_load,
    bucket_of,
    build_load_model,
    dispatch_step,
    placed_times,
    placed_work,
    sequence_lower_bound,
)
from lorafleet.planner.candidates import valid_candidates
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.placement import build_plan, with_expectation
from lorafleet.planner.problem import Candidate, max_replicas
from lorafleet.planner.schedule import Phase, Schedule, pow2_boundaries, select_tasks
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.work import by_identity
from lorafleet.work import memo as work_memo
from lorafleet.workload import Workload


class BaselineKind(StrEnum):
    TASK_FUSED_PADDING = "task-fused-padding"
    """All tasks on the best homogeneous config, static power-of-two padding buckets."""
    TASK_FUSED_PACKING = "task-fused-packing"
    """All tasks on the best homogeneous config, sequences packed up to M tokens."""
    TASK_SEQUENTIAL = "task-sequential"
    """Each task alone on its best homogeneous config, one after another."""


def padding_policy(longest: int, max_tokens: int, policy: DispatchPolicy) -> DispatchPolicy:
    """LobRA's Task-Fused dispatch: static power-of-two buckets, padded micro-batches; pipelined replicas
    streaming ``policy``'s window (the baselines run in the window lorafleet's plan runs in)."""
    return DispatchPolicy(
        options=DispatchOptions(microbatch_mode=MicroBatchMode.PADDING),
        static_boundaries=pow2_boundaries(longest, max_tokens),
        pipeline_window=policy.pipeline_window,
    )


def packing_policy(policy: DispatchPolicy) -> DispatchPolicy:
    """Packed micro-batches of up to M tokens (buckets, ``policy``'s count, only steer the balance estimate);
    pipelined replicas streaming ``policy``'s window."""
    return DispatchPolicy(
        options=DispatchOptions(n_buckets=policy.options.n_buckets, microbatch_mode=MicroBatchMode.PACKING),
        pipeline_window=policy.pipeline_window,
    )


def estimated_makespan(
    batch: GlobalBatch,
    candidate: Candidate,
    replicas: int,
    cost_model: CostModel,
    mode: MicroBatchMode,
    policy: DispatchPolicy,
    above: float = float("inf"),
) -> float:
    """The dispatcher's estimate of ``batch`` on ``replicas`` copies of one config, under the
    baseline's policy: LobRA's static power-of-two buckets, padded (:func:`padding_policy`), or
    the dispatcher's own buckets, packed (:func:`packing_policy`), each in ``policy``'s window.

    Padded, the load model as placed (:func:`~lorafleet.dispatch.placement.placed_times`) is that
    estimate exactly and needs no micro-batches (Task-Sequential judges every config for every
    task: hundreds of estimates); packed, the step's micro-batches are priced
    (:func:`~lorafleet.dispatch.step.placed_work`), as lorafleet's plans are judged, the replicas one by one
    until one is priced above ``above`` seconds: then the slowest priced so far, a value above ``above`` and
    at most the estimate (the caller only asks whether the estimate is above it).
    """
    cls = ConfigClass(config=candidate.config, max_tokens=candidate.max_tokens, replicas=tuple(range(replicas)))
    if mode is MicroBatchMode.PADDING:
        boundaries = static_boundaries(batch, candidate)
        load = build_load_model(
            (cls,),
            cost_model,
            boundaries,
            batch.lengths,
            bucket_of(batch.lengths, boundaries),
            mode,
        )
        return float(placed_times(load, load.counts[None, :]).max())
    packing = packing_policy(policy)
    _, load = bucket_load(batch, (cls,), cost_model, packing.options)
    counts = load.counts[None, :]
    work = placed_work(batch, load, counts, cost_model, mode, window=packing.pipeline_window, above=above)
    return max(t for _, t in work)


def best_homogeneous(
    batch: GlobalBatch,
    longest: int,
    candidates: Sequence[Candidate],
    cost_model: CostModel,
    cluster: ClusterSpec,
    mode: MicroBatchMode,
    policy: DispatchPolicy,
    sequences: int | None = None,
) -> tuple[Candidate, int]:
    """The config holding ``longest`` tokens (and its replica count, as many as fit, at most ``sequences``: a
    step's, more would be idle) with the fewest estimated GPU-seconds for ``batch``.

    The configs are estimated in the order of a lower bound of their GPU-seconds (:func:`gpu_seconds_bound`),
    and those whose bound is above the best estimate so far are not estimated: the choice is the one of every
    config estimated (Task-Sequential judges every config for every task: at service scale 64 tasks x 38
    configs, most of them far from the best). A packed estimate stops at the first replica whose time t has
    t p N above the best GPU-seconds so far (by :data:`BOUND_SLACK`, against rounding): the config's estimate is
    at least t, so it cannot win, and the rest of its replicas are not priced (service-64's Task-Fused packing
    prices 510 of 1,285 replicas, docs/planner.md).

    Raises:
        ValueError: no candidate holds the longest sequence.
    """
    holders = [c for c in candidates if c.max_tokens >= longest]
    if not holders:
        raise ValueError(f"no config holds a {longest}-token sequence")
    counts = max_replicas([c.config for c in holders], cluster, sequences)
    deployable = [(c, int(p)) for c, p in zip(holders, counts, strict=True) if p > 0]
    bounds = [gpu_seconds_bound(batch, c, p, cost_model, mode) for c, p in deployable]
    best: tuple | None = None
    for k in sorted(range(len(deployable)), key=lambda k: bounds[k]):
        c, p = deployable[k]
        if best is not None and bounds[k] * (1 - BOUND_SLACK) > best[0]:
            break  # this bound and every later one is above the best estimate: none of them can win
        above = float("inf") if best is None else best[0] * (1 + BOUND_SLACK) / (p * c.n_gpus)
        makespan = estimated_makespan(batch, c, p, cost_model, mode, policy, above)
        if makespan > above:
            continue  # its estimate is at least this, so its GPU-seconds are above the best's
        scored = (makespan * p * c.n_gpus, p * c.n_gpus, c.config, c, p)
        if best is None or scored[:3] < best[:3]:
            best = scored
    assert best is not None
    return best[3], best[4]


BOUND_SLACK = 1e-9
"""A config is skipped only when its bound is above the best estimate by more than this fraction (rounding)."""


def static_boundaries(batch: GlobalBatch, candidate: Candidate) -> np.ndarray:
    """LobRA's static buckets of ``batch`` on ``candidate`` (:func:`pow2_boundaries` of its longest sequence,
    capped at M): where a padded baseline pads each sequence to."""
    return np.asarray(pow2_boundaries(int(batch.lengths.max()), candidate.max_tokens), dtype=np.int64)


def gpu_seconds_bound(
    batch: GlobalBatch, candidate: Candidate, replicas: int, cost_model: CostModel, mode: MicroBatchMode
) -> float:
    """A lower bound on :func:`estimated_makespan` x the deployment's GPUs: the slowest of ``replicas`` takes at
    least its step overhead o plus max(Σ_q c_q / replicas, c_top (1 + B)). 0 for a cost model with a negative
    coefficient (nothing is bounded).

    Packed, c_q = r(l_q), the least stage time a sequence of length l_q adds to a replica
    (``dispatch.sequence_lower_bound``), c_top = max_q r(l_q), and B = 0. Padded, the estimate is the load model
    as placed (``dispatch.load``): LobRA's static buckets s_j (:func:`static_boundaries`), n rows of bucket j on a
    replica cost α_j n + β_j ceil(n / b_j) >= n (α_j + β_j / b_j) (b_j = floor(M / s_j); α, β >= 0 read off
    t(1, s_j) and t(2, s_j) as the load model reads them), so c_q = α_j + β_j / b_j for a row of bucket j; and the
    replica holding a row of the top bucket present pays at least t(1, s_top) of compute and the drained bubble
    B = pp - 1 slots of its largest micro-batch, each at least t(1, s_top). The bubble lets Task-Sequential skip
    most pipelined configs: service-128's baselines estimated 4,447 configs with r(l) alone and 609 with these
    (docs/planner.md). (A packed step's least bubble, (pp - 1) / W in a window of W steps, also averaged over
    the busy replicas, skipped no config of the examples' Task-Fused packing: not charged.)"""
    if len(batch) == 0:
        return 0.0
    if mode is MicroBatchMode.PADDING:
        s = static_boundaries(batch, candidate)
        rows = np.bincount(bucket_of(batch.lengths, s), minlength=s.size)
        rates = _padded_rates(cost_model, candidate, s)
        if rates is None:
            return 0.0
        one, per_row = rates
        top = one[np.flatnonzero(rows)[-1]]
        busiest = max(
            float(per_row @ rows) / replicas, float(top) * (1 + cost_model.drained_bubble_slots(candidate.config))
        )
    else:
        r = sequence_lower_bound(cost_model, candidate.config, candidate.max_tokens, batch.lengths)
        busiest = max(float(r.sum()) / replicas, float(r.max()))
    return (busiest + cost_model.step_overhead(candidate.config)) * replicas * candidate.n_gpus


def _padded_rates(cost_model: CostModel, candidate: Candidate, s: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`gpu_seconds_bound`'s padded rates over static buckets ``s``: t(1, s_j) and a row's least compute
    α_j + β_j / b_j (None when some α_j or β_j is negative: nothing is bounded). A function of the config, M and
    ``s`` alone, which Task-Sequential asks for again for every task (service-128: 1,910 bounds), so a counted scope
    keeps them in its memo (the cost model by identity, held in the entry)."""

    def rates() -> tuple[np.ndarray, np.ndarray] | None:
        one, two = (np.asarray(cost_model.microbatch_time(candidate.config, b, s), dtype=float) for b in (1, 2))
        alpha, beta = two - one, 2 * one - two
        # static buckets are capped at M: b_j >= 1
        return None if alpha.min() < 0 or beta.min() < 0 else (one, alpha + beta / (candidate.max_tokens // s))

    memo = work_memo("padded rates")
    if memo is None:
        return rates()
    return by_identity(memo, cost_model, (candidate.config, candidate.max_tokens, s.tobytes()), rates)


def layouts_across_pools(
    candidates: Sequence[Candidate], longest: int, cluster: ClusterSpec, sequences: int | None = None
) -> list[tuple[tuple[Candidate, int], ...]]:
    """Every layout ⟨tp, pp[, rc]⟩ that holds ``longest`` tokens on every pool of ``cluster``: its candidate
    on each pool and as many replicas of it as fit there (at most ``sequences`` each), in pool order."""
    by_layout: dict[ParallelConfig, dict[str, Candidate]] = {}
    for c in candidates:
        if c.max_tokens >= longest:
            by_layout.setdefault(c.config.layout, {})[c.config.pool] = c
    out = []
    for per_pool in by_layout.values():
        if set(per_pool) != set(cluster.pool_names):
            continue
        chosen = [per_pool[name] for name in cluster.pool_names]
        counts = max_replicas([c.config for c in chosen], cluster, sequences)
        if all(n > 0 for n in counts):
            out.append(tuple((c, int(n)) for c, n in zip(chosen, counts, strict=True)))
    return out


def _policy_of(mode: MicroBatchMode, longest: int, max_tokens: int, policy: DispatchPolicy) -> DispatchPolicy:
    """A baseline's own dispatch policy (:func:`padding_policy` or :func:`packing_policy`)."""
    return padding_policy(longest, max_tokens, policy) if mode is MicroBatchMode.PADDING else packing_policy(policy)


def best_across_pools(
    workload: Workload,
    batch: GlobalBatch,
    longest: int,
    candidates: Sequence[Candidate],
    cost_model: CostModel,
    cluster: ClusterSpec,
    mode: MicroBatchMode,
    policy: DispatchPolicy,
    name: str,
    sequences: int | None = None,
) -> DeploymentPlan:
    """The fused baseline's plan on a fleet of several pools: the layout of :func:`layouts_across_pools`
    whose step the dispatcher estimates cheapest (GPU-seconds, or cost at the pools' prices when every pool
    has one), run under the baseline's own policy (static buckets capped at the least M of its replicas);
    ``sequences``: a step's, the most replicas of the layout on a pool.

    Raises:
        ValueError: no layout holds the longest sequence on every pool.
    """
    scored = []
    for deployment in layouts_across_pools(candidates, longest, cluster, sequences):
        own = _policy_of(mode, longest, min(c.max_tokens for c, _ in deployment), policy)
        replicas = [(c.config, c.max_tokens, n) for c, n in deployment]
        plan = build_plan(workload, cluster, replicas, solver=f"baseline:{name}", policy=own, cost_model=cost_model)
        makespan = dispatch_step(batch, plan, cost_model).estimated_makespan_s
        price = price_per_second(plan, cluster)
        scored.append((makespan * (price if price is not None else plan.used_gpus), plan.used_gpus, plan))
    if not scored:
        raise ValueError(f"no layout holds a {longest}-token sequence on every pool of {cluster.describe()}")
    return min(scored, key=lambda x: x[:2])[2]


def _phase(
    workload: Workload,
    tasks: tuple[int, ...],
    batch: GlobalBatch,
    candidates: Sequence[Candidate],
    cost_model: CostModel,
    cluster: ClusterSpec,
    mode: MicroBatchMode,
    policy: DispatchPolicy,
    name: str,
    chosen: dict[tuple[int, tuple[int, ...]], tuple[Candidate, int, StepPlan]] | None = None,
) -> Phase:
    """The tasks' phase on their best homogeneous config; it must hold the longest sequence the
    tasks can present (any step may bring it), not just the expected batch's. A step's sequences (``batch``'s)
    cap its replicas, as they cap lorafleet's (``problem.gpu_budget_rows``): on a fleet far larger than the
    batch, the replicas beyond them would be idle. The plan records its expected step as lorafleet's plan does
    (``with_expectation``: the buckets a plan check asks for, the expected times).

    ``chosen``, for phases of one task on one pool, padded: the choices already made and the expected steps already
    dispatched, by (longest, the task's expected lengths in order), all that either reads of the task. Padded,
    :func:`best_homogeneous`'s bounds and estimates are load models of the lengths; and a one-task batch dispatches
    the same whichever task it is (placement orders by task first, the micro-batches are task-major, the window's
    stall compares task ids: all one value; ``tests/planner/test_baselines.py`` pins it). Task-Sequential's tasks of
    equal expected lengths (a sweep's members, tenants of one preset) share both (service-sweeps: 1,024 tasks, 49
    distinct; service-128: 128, 49)."""
    longest = max(workload.tasks[k].lengths.max_length for k in tasks)
    part = select_tasks(batch, tasks)
    if len(cluster.pools) > 1:
        plan = best_across_pools(
            workload, part, longest, candidates, cost_model, cluster, mode, policy, name, len(batch)
        )
        return Phase(tasks=tasks, plan=with_expectation(plan, dispatch_step(part, plan, cost_model)))
    key = (longest, tuple(part.lengths.tolist()))
    shared = chosen.get(key) if chosen is not None else None
    if shared is None:
        cand, p = best_homogeneous(part, longest, candidates, cost_model, cluster, mode, policy, len(batch))
    else:
        cand, p, _ = shared
    plan = build_plan(
        workload,
        cluster,
        [(cand.config, cand.max_tokens, p)],
        solver=f"baseline:{name}",
        policy=_policy_of(mode, longest, cand.max_tokens, policy),
        cost_model=cost_model,
    )
    if shared is None:
        shared = (cand, p, dispatch_step(part, plan, cost_model))
        if chosen is not None:
            chosen[key] = shared
    return Phase(tasks=tasks, plan=with_expectation(plan, shared[2]))


def baseline_schedules(
    workload: Workload,
    expected: GlobalBatch,
    candidates: Sequence[Candidate],
    cost_model: CostModel,
    cluster: ClusterSpec,
    policy: DispatchPolicy,
) -> tuple[Schedule, ...]:
    """Task-Fused padding, Task-Fused packing and Task-Sequential, chosen on the expected batch, with
    lorafleet's ``policy``'s bucket count and pipeline window."""
    everyone = tuple(range(len(workload.tasks)))
    fused = {
        kind: Schedule(
            name=kind.value,
            phases=(_phase(workload, everyone, expected, candidates, cost_model, cluster, mode, policy, kind.value),),
        )
        for kind, mode in (
            (BaselineKind.TASK_FUSED_PADDING, MicroBatchMode.PADDING),
            (BaselineKind.TASK_FUSED_PACKING, MicroBatchMode.PACKING),
        )
    }
    chosen: dict[tuple[int, tuple[int, ...]], tuple[Candidate, int, StepPlan]] = {}
    sequential = Schedule(
        name=BaselineKind.TASK_SEQUENTIAL.value,
        phases=tuple(
            _phase(
                workload,
                (k,),
                expected,
                candidates,
                cost_model,
                cluster,
                MicroBatchMode.PADDING,
                policy,
                f"{BaselineKind.TASK_SEQUENTIAL.value}:{workload.tasks[k].name}",
                chosen,
            )
            for k in everyone
        ),
    )
    return (*fused.values(), sequential)


def workload_baselines(
    workload: Workload, cluster: ClusterSpec, cost_model: CostModel, policy: DispatchPolicy
) -> tuple[Schedule, ...]:
    """The three baselines of ``workload`` on ``cluster``, chosen on its expected batch as ``plan_deployment``
    chooses them with ``policy`` (for a command that runs a plan made earlier and needs only the baselines
    beside it: the plan's policy)."""
    return baseline_schedules(
        workload, expected_global_batch(workload), valid_candidates(cost_model, cluster), cost_model, cluster, policy
    )
