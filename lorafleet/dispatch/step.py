"""One step's dispatch, top to bottom: buckets -> class totals -> replicas -> micro-batches -> StepPlan.

1. Bucketing: the padding-minimising DP over the step's lengths, with the configs' max
   tokens as barriers (:mod:`.bucketing`); optionally the bucket count with the least
   modelled makespan instead.
2. Balance: class totals d_ij by the fast method, the exact MILP (bounded by the fast
   result, which is used with a note when the solve gives nothing), or LobRA's length
   baseline (:func:`balance_load`, over :mod:`.balance` and :mod:`.ilp`; the planner judges
   deployments through the same function).
3. Placement of the actual sequences on replicas (:mod:`.placement`), micro-batches per
   replica (:mod:`.microbatch`; a pipelined replica's packed ones :mod:`.pipelined`), and each
   replica's time from the cost model (:func:`placed_work`, which the planner also judges
   deployments by).

Nothing here warns or keeps state: the same inputs give the same plan, so the look-ahead
dispatcher can compute it on another thread.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch.balance import Assignment, balance_by_length, balance_fast
from lorafleet.dispatch.bucketing import BucketingResult, acting_barriers, bucket_of, optimal_buckets_by_count
from lorafleet.dispatch.ilp import solve_dispatch_ilp
from lorafleet.dispatch.load import ConfigClass, LoadModel, build_load_model, config_classes
from lorafleet.dispatch.microbatch import packed_with_tasks, padded_microbatches
from lorafleet.dispatch.pipelined import one_two_times, pipelined_packing
from lorafleet.dispatch.placement import place_sequences
from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan, GlobalBatch, MicroBatch, ReplicaWork, StepPlan
from lorafleet.solvers import SolveResult
from lorafleet.specs.dispatch import DispatchMethod, DispatchOptions, MicroBatchMode
from lorafleet.work import count as count_work
from lorafleet.work import memo as work_memo


@dataclass(frozen=True)
class DispatchOutcome:
    """A step's plan and what the caller should know about how it was made."""

    plan: StepPlan
    modelled_makespan_s: float
    """The load model's makespan of the chosen class totals: what the balancer minimised. In padding
    mode an upper bound of the plan's estimate; in packing mode an approximation of it (the
    load model spreads each micro-batch's constant over its tokens, :mod:`.load`)."""
    fallback: str | None = None
    """Why the exact solve's answer was not used (the fast one was); None otherwise."""
    lower_bound_s: float | None = None
    """Exact method only: the solver's proven lower bound on the modelled makespan."""


def _check_lengths(batch: GlobalBatch, classes: tuple[ConfigClass, ...]) -> None:
    where = f"<global batch of step {batch.step}>"
    if batch.lengths.size and batch.lengths.min() < 1:
        q = int(np.argmin(batch.lengths))
        raise InputError(where, f"lengths[{q}]", f"sequence length must be >= 1, got {int(batch.lengths[q])}")
    largest = max(c.max_tokens for c in classes)
    too_long = np.flatnonzero(batch.lengths > largest)
    if too_long.size:
        q = int(too_long[0])
        raise InputError(
            where,
            f"lengths[{q}]",
            f"{int(batch.lengths[q])} tokens (task {int(batch.task_ids[q])}) exceed every replica's "
            f"max tokens (largest M = {largest}); {too_long.size} such sequences",
        )


def _balance(load: LoadModel, method: DispatchMethod) -> Assignment:
    return balance_by_length(load) if method is DispatchMethod.LENGTH else balance_fast(load)


EXACT_DISPATCH = "the exact dispatch ILP"


@dataclass(frozen=True)
class Balanced:
    """Class totals d_ij of one load model, and how they were found."""

    assignment: Assignment
    method: str
    """``fast``, ``length``, ``milp:<solver>:<status>``, or ``milp:<solver>:<status>->fast`` when the
    exact solve gave nothing usable and the fast answer stands."""
    result: SolveResult | None = None
    """The exact solve's result (None for fast and length)."""
    fallback: str | None = None
    """Why the exact solve's answer was not used (:meth:`SolveResult.unusable_note`); None otherwise."""
    lower_bound_s: float | None = None
    """Exact only: the solver's proven lower bound on the modelled makespan."""


def balance_load(
    load: LoadModel, options: DispatchOptions, first: Assignment | None = None, what: str = EXACT_DISPATCH
) -> Balanced:
    """The class totals of ``load`` by ``options.method``: the fast balance, LobRA's length baseline, or
    the exact MILP bounded by the fast answer (``first``, computed when not given), which stands, with a
    note naming ``what`` was solved, when the solve gives nothing usable. The one sequence every step
    and every judged deployment goes through; nothing here warns (the caller does, with the note)."""
    assignment = first if first is not None else _balance(load, options.method)
    if options.method is not DispatchMethod.EXACT:
        return Balanced(assignment=assignment, method=options.method.value)
    outcome = solve_dispatch_ilp(
        load, options.solver, options.time_limit_s, options.gap_rel, upper_bound_s=assignment.makespan_s
    )
    if outcome.assignment is not None:
        return Balanced(
            assignment=outcome.assignment,
            method=f"milp:{outcome.result}",
            result=outcome.result,
            lower_bound_s=outcome.lower_bound_s,
        )
    return Balanced(
        assignment=assignment,
        method=f"milp:{outcome.result}->fast",
        result=outcome.result,
        fallback=outcome.result.unusable_note(what, "the fast dispatch stands"),
        lower_bound_s=outcome.lower_bound_s,
    )


def _candidate_bucketings(
    batch: GlobalBatch, classes: tuple[ConfigClass, ...], options: DispatchOptions
) -> list[BucketingResult]:
    """The least-padding boundaries for every bucket count up to R (at least one bucket per memory class
    present: barriers at every M), fewest buckets first.

    They depend on the batch's lengths and the classes' M only, the M above the longest sequences not at all
    (:func:`~.bucketing.acting_barriers`), and a plan asks for the same ones again (deployments of one config set, or
    of sets that differ in such M, judged on the expected batch; a sampled batch raced on plans of the same M): a
    counted scope (a plan) keeps them in its memo (:func:`lorafleet.work.memo`)."""
    barriers = acting_barriers(batch.lengths, options.bucket_alignment, sorted({c.max_tokens for c in classes}))
    key = (batch.lengths.tobytes(), options.n_buckets, options.bucket_alignment, tuple(barriers))
    memo = work_memo("bucketings")
    if memo is not None and key in memo:
        return memo[key]
    present = np.unique(np.searchsorted(barriers, batch.lengths, side="left")).size
    bucketings = optimal_buckets_by_count(
        batch.lengths, max(options.n_buckets, present), alignment=options.bucket_alignment, barriers=barriers
    )
    if memo is not None:
        memo[key] = bucketings
    return bucketings


def _load_of(
    batch: GlobalBatch,
    classes: tuple[ConfigClass, ...],
    cost_model: CostModel,
    bucketing: BucketingResult,
    mode: MicroBatchMode,
) -> LoadModel:
    bucket = bucket_of(batch.lengths, bucketing.boundaries)
    return build_load_model(classes, cost_model, np.array(bucketing.boundaries), batch.lengths, bucket, mode)


def bucket_load(
    batch: GlobalBatch, classes: tuple[ConfigClass, ...], cost_model: CostModel, options: DispatchOptions
) -> tuple[BucketingResult, LoadModel]:
    """The step's least-padding buckets with R buckets and their load model, not balanced: what
    :func:`choose_buckets` gives without ``choose_buckets_by_makespan``, for a caller that needs the load
    model only (a bound, a homogeneous deployment) or balances it itself."""
    bucketing = _candidate_bucketings(batch, classes, options)[-1]
    return bucketing, _load_of(batch, classes, cost_model, bucketing, options.microbatch_mode)


def choose_buckets(
    batch: GlobalBatch, classes: tuple[ConfigClass, ...], cost_model: CostModel, options: DispatchOptions
) -> tuple[BucketingResult, LoadModel, Assignment]:
    """The step's buckets, their load model and the heuristic assignment on them.

    At least one bucket per memory class present (barriers at every M). By default the
    least-padding boundaries with R buckets (:func:`bucket_load`); with ``choose_buckets_by_makespan``,
    among the optima for every bucket count up to R, the one whose heuristic makespan is least
    (fewer buckets on ties).
    """
    if not options.choose_buckets_by_makespan:
        bucketing, load = bucket_load(batch, classes, cost_model, options)
        return bucketing, load, _balance(load, options.method)
    best = None
    for bucketing in _candidate_bucketings(batch, classes, options):
        load = _load_of(batch, classes, cost_model, bucketing, options.microbatch_mode)
        assignment = _balance(load, options.method)
        if best is None or assignment.makespan_s < best[2].makespan_s:
            best = (bucketing, load, assignment)
    return best


def placed_work(
    batch: GlobalBatch,
    load: LoadModel,
    counts: np.ndarray,
    cost_model: CostModel,
    mode: MicroBatchMode,
    classes: Collection[int] | None = None,
    window: int = 1,
    above: float = float("inf"),
) -> list[tuple[tuple[MicroBatch, ...], float]]:
    """Every replica's micro-batches and estimated time, in plan order, once class totals ``counts`` (K, R)
    are placed: the sequences dealt by :func:`~.placement.place_sequences`, cut by the mode's
    micro-batcher and priced by ``CostModel.replica_time`` times the class's ``time_scale`` (0 for a
    replica given nothing).

    The step plan's work, and what the planner judges a deployment by: one code path, so the
    planner's expected makespan is the dispatcher's estimate of the same step. With ``classes``,
    only those classes' replicas are cut and priced (the others are left empty).

    With a pipeline window of ``window > 1`` steps (the policy's ``pipeline_window``) every replica's
    micro-batches are ordered task-major (:mod:`.microbatch`), and each replica is priced with its
    micro-batches' tasks (their stall at the window's step boundaries).

    The replicas are priced in plan order, and the pricing stops at the first one priced above ``above``
    seconds, leaving the rest empty: the step's makespan is then above ``above`` whatever they hold (a caller
    that only asks whether the step is at most ``above``, as a baseline comparing its configs does, needs no more).
    """
    task_major = window > 1
    cost_model = cost_model.spanning(c.config.pool for c in load.classes)  # as build_load_model priced them
    bucket = bucket_of(batch.lengths, load.boundaries)
    n_replicas = sum(len(c.replicas) for c in load.classes)
    held = place_sequences(load, counts, bucket, batch.lengths, batch.task_ids, n_replicas)
    padded_len = load.boundaries[bucket] if bucket.size else bucket
    lengths_key = batch.lengths.tobytes() if mode is MicroBatchMode.PACKING else b""  # hashed once, read by class
    work: list[tuple[tuple[MicroBatch, ...], float]] = [((), 0.0)] * n_replicas
    for i, cls in enumerate(load.classes):
        if classes is not None and i not in classes:
            continue
        pipelined = mode is MicroBatchMode.PACKING and cls.config.pp > 1
        one_two = one_two_times(cost_model, cls.config, batch.lengths, lengths_key) if pipelined else None
        for r in cls.replicas:
            if pipelined:
                # the bubble pays the largest micro-batch again: balanced, counted, and priced there
                mbs, _, seconds = pipelined_packing(
                    held[r],
                    batch.lengths,
                    batch.task_ids,
                    cls.max_tokens,
                    cost_model,
                    cls.config,
                    window,
                    task_major=task_major,
                    one_two=one_two,
                )
            else:
                if mode is MicroBatchMode.PADDING:
                    mbs = padded_microbatches(
                        held[r], batch.lengths, batch.task_ids, padded_len, cls.max_tokens, task_major=task_major
                    )
                    tasks: Sequence[Collection[int]] = [mb.task_ids for mb in mbs]
                else:
                    mbs, tasks = packed_with_tasks(
                        held[r], batch.lengths, batch.task_ids, cls.max_tokens, task_major=task_major
                    )
                seconds = cost_model.replica_time(cls.config, mbs, tasks, window=window)  # each reads as its shape
            work[r] = (tuple(mbs), cls.time_scale * seconds)
            if work[r][1] > above:
                return work
    return work


def _replica_work(
    batch: GlobalBatch,
    plan: DeploymentPlan,
    cost_model: CostModel,
    options: DispatchOptions,
    window: int,
    load: LoadModel,
    assignment: Assignment,
) -> tuple[ReplicaWork, ...]:
    work = placed_work(batch, load, assignment.counts, cost_model, options.microbatch_mode, window=window)
    return tuple(
        ReplicaWork(replica_id=replica.replica_id, microbatches=mbs, estimated_time_s=estimate)
        for replica, (mbs, estimate) in zip(plan.replicas, work, strict=True)
    )


def _priced_speeds(classes: tuple[ConfigClass, ...], n_replicas: int) -> tuple[float, ...]:
    """The factor each replica (plan order) was priced at: its class's ``time_scale``."""
    speeds = [1.0] * n_replicas
    for cls in classes:
        for r in cls.replicas:
            speeds[r] = cls.time_scale
    return tuple(speeds)


def solve_step(
    batch: GlobalBatch,
    plan: DeploymentPlan,
    cost_model: CostModel,
    options: DispatchOptions,
    speed: Sequence[float] | None = None,
    window: int = 1,
) -> DispatchOutcome:
    """Dispatch one global batch on the plan (see the module docstring); never skips the step.

    ``speed``, one time factor per replica (online recalibration), prices each replica's times
    that much slower (``load.config_classes``); the step plan records the factor each was priced at.
    ``window``: the pipeline window the step runs in (the policy's; :func:`placed_work`).
    """
    start = time.perf_counter()
    count_work("dispatches")
    classes = config_classes(plan, cost_model, speed)
    _check_lengths(batch, classes)
    bucketing, load, first = choose_buckets(batch, classes, cost_model, options)
    balanced = balance_load(load, options, first, what=f"step {batch.step}: {EXACT_DISPATCH}")
    work = _replica_work(batch, plan, cost_model, options, window, load, balanced.assignment)
    step_plan = StepPlan(
        step=batch.step,
        bucket_boundaries=bucketing.boundaries,
        work=work,
        estimated_makespan_s=max((w.estimated_time_s for w in work), default=0.0),
        method=balanced.method,
        solve_s=time.perf_counter() - start,
        truncated=batch.truncated,
        rejected=batch.rejected,
        speed=_priced_speeds(classes, len(plan.replicas)) if speed is not None else (),
    )
    return DispatchOutcome(
        plan=step_plan,
        modelled_makespan_s=balanced.assignment.makespan_s,
        fallback=balanced.fallback,
        lower_bound_s=balanced.lower_bound_s,
    )
