"""One step's dispatch, top to bottom: buckets -> class totals -> replicas -> micro-batches -> StepPlan.

1. Bucketing: the padding-minimising DP over the step's lengths, with the configs' max
   tokens as barriers (:mod:`.bucketing`); optionally the bucket count with the least
   modelled makespan instead.
2. Balance: class totals d_ij by the fast method, the exact MILP (bounded by the fast
   result, which is used with a note when the solve gives nothing), or LobRA's length
   baseline (:mod:`.balance`, :mod:`.ilp`).
3. Placement of the actual sequences on replicas (:mod:`.placement`), micro-batches per
   replica (:mod:`.microbatch`), and each replica's time from the cost model.

Nothing here warns or keeps state: the same inputs give the same plan, so the look-ahead
dispatcher can compute it on another thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch.balance import Assignment, balance_by_length, balance_fast
from lorafleet.dispatch.bucketing import BucketingResult, bucket_of, optimal_buckets_by_count
from lorafleet.dispatch.ilp import solve_dispatch_ilp
from lorafleet.dispatch.load import ConfigClass, LoadModel, build_load_model, config_classes
from lorafleet.dispatch.microbatch import packed_microbatches, padded_microbatches
from lorafleet.dispatch.options import DispatchMethod, DispatchOptions, MicroBatchMode
from lorafleet.dispatch.placement import place_sequences
from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan, GlobalBatch, ReplicaWork, StepPlan


@dataclass(frozen=True)
class DispatchOutcome:
    """A step's plan and what the caller should know about how it was made."""

    plan: StepPlan
    modelled_makespan_s: float
    """The load model's makespan of the chosen class totals (an upper bound of the plan's estimate)."""
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
        raise InputError(where, f"lengths[{q}]",
                         f"{int(batch.lengths[q])} tokens (task {int(batch.task_ids[q])}) exceed every replica's "
                         f"max tokens (largest M = {largest}); {too_long.size} such sequences")


def _balance(load: LoadModel, method: DispatchMethod) -> Assignment:
    return balance_by_length(load) if method is DispatchMethod.LENGTH else balance_fast(load)


def choose_buckets(
    batch: GlobalBatch, classes: tuple[ConfigClass, ...], cost_model: CostModel, options: DispatchOptions
) -> tuple[BucketingResult, LoadModel, Assignment]:
    """The step's buckets, their load model and the heuristic assignment on them.

    At least one bucket per memory class present (barriers at every M). By default the
    least-padding boundaries with R buckets; with ``choose_buckets_by_makespan``, among the
    optima for every bucket count up to R, the one whose heuristic makespan is least
    (fewer buckets on ties).
    """
    barriers = sorted({c.max_tokens for c in classes})
    present = np.unique(np.searchsorted(barriers, batch.lengths, side="left")).size
    candidates = optimal_buckets_by_count(batch.lengths, max(options.n_buckets, present),
                                          alignment=options.bucket_alignment, barriers=barriers)
    if not options.choose_buckets_by_makespan:
        candidates = candidates[-1:]
    best = None
    for bucketing in candidates:
        bucket = bucket_of(batch.lengths, bucketing.boundaries)
        load = build_load_model(classes, cost_model, np.array(bucketing.boundaries), batch.lengths, bucket,
                                options.microbatch_mode)
        assignment = _balance(load, options.method)
        if best is None or assignment.makespan_s < best[2].makespan_s:
            best = (bucketing, load, assignment)
    return best


def _replica_work(
    batch: GlobalBatch, plan: DeploymentPlan, cost_model: CostModel, options: DispatchOptions,
    load: LoadModel, assignment: Assignment,
) -> tuple[ReplicaWork, ...]:
    bucket = bucket_of(batch.lengths, load.boundaries)
    held = place_sequences(load, assignment.counts, bucket, batch.lengths, batch.task_ids, len(plan.replicas))
    padded_len = load.boundaries[bucket] if bucket.size else bucket
    work = []
    for replica, seqs in zip(plan.replicas, held, strict=True):
        if options.microbatch_mode is MicroBatchMode.PADDING:
            mbs = padded_microbatches(seqs, batch.lengths, batch.task_ids, padded_len, replica.max_tokens)
        else:
            mbs = packed_microbatches(seqs, batch.lengths, batch.task_ids, replica.max_tokens)
        estimate = cost_model.replica_time(replica.config, [mb.shape for mb in mbs])
        work.append(ReplicaWork(replica_id=replica.replica_id, microbatches=tuple(mbs), estimated_time_s=estimate))
    return tuple(work)


def solve_step(batch: GlobalBatch, plan: DeploymentPlan, cost_model: CostModel, options: DispatchOptions) -> DispatchOutcome:
    """Dispatch one global batch on the plan (see the module docstring); never skips the step."""
    start = time.perf_counter()
    classes = config_classes(plan, cost_model)
    _check_lengths(batch, classes)
    bucketing, load, assignment = choose_buckets(batch, classes, cost_model, options)
    method, fallback, lower_bound = options.method.value, None, None
    if options.method is DispatchMethod.EXACT:
        outcome = solve_dispatch_ilp(load, options.solver, options.time_limit_s, options.gap_rel,
                                     upper_bound_s=assignment.makespan_s)
        lower_bound = outcome.lower_bound_s
        if outcome.assignment is not None:
            assignment, method = outcome.assignment, f"milp:{outcome.result}"
        else:
            method = f"milp:{outcome.result}->fast"
            fallback = (f"step {batch.step}: the {outcome.result.solver.value} dispatch MILP gave no usable solution "
                        f"({outcome.result.status.value} after {outcome.result.wall_s:.2f} s); using the fast dispatch")
    work = _replica_work(batch, plan, cost_model, options, load, assignment)
    step_plan = StepPlan(
        step=batch.step,
        bucket_boundaries=bucketing.boundaries,
        work=work,
        estimated_makespan_s=max((w.estimated_time_s for w in work), default=0.0),
        method=method,
        solve_s=time.perf_counter() - start,
        truncated=batch.truncated,
        rejected=batch.rejected,
    )
    return DispatchOutcome(plan=step_plan, modelled_makespan_s=assignment.makespan_s, fallback=fallback,
                           lower_bound_s=lower_bound)
