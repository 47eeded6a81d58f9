"""A deployment's expected dispatch: how the planner judges one deployment.

Every deployment p is judged by the dispatcher itself on the expected batch: the class
totals d_ij balanced as a step would be (``balance_fast``, milliseconds; re-solved by the
exact dispatch ILP, bounded by the fast answer, for the best few), the sequences placed on
the replicas, cut into micro-batches (padded or packed) and priced by the cost model as a
step is (``dispatch.step.placed_work``); the slowest replica's estimate is the plan's
expected makespan. The balancers minimise the load model (LobRA's Eq. 1-3 for a fixed p,
every replica of a config taking ceil(d_ij / p_i) rows of bucket j, Eq. 12, and in packing
mode each sequence's token share of a micro-batch's constant); the step as placed gives
only d_ij mod p_i replicas a ceil share, and packs real micro-batches, each paying its whole
constant at its longest sequence, so it is judged as its steps will run.

The ranking of judged deployments is :mod:`.objective`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from lorafleet.dispatch import Balanced, DispatchMethod, DispatchOptions, LoadModel, balance_load, placed_work
from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner.candidates import lower_bound
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.problem import PlanningProblem
from lorafleet.solvers import SolveResult
from lorafleet.work import count as count_work


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Evaluation:
    """A deployment's expected dispatch: the dispatcher's balance of the expected batch on it."""

    class_counts: np.ndarray
    """d_ij: sequences of each bucket on each deployed config, shape (K, R) (the load model's classes and buckets)."""
    class_times: np.ndarray
    """T_i: the dispatcher's estimate of the slowest replica of each deployed config once d_ij is
    placed and cut into micro-batches (:func:`~lorafleet.dispatch.step.placed_work`; the
    dispatcher's class order)."""
    makespan: float
    """t̂ = max_i T_i (Eq. 1), the dispatcher's estimate of the expected step: the ranking value."""
    method: str
    """``fast`` or the exact ILP's ``milp:<solver>:<status>``."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PoolEntry:
    """One deployment the planner considered, with what it learnt about it."""

    replicas: np.ndarray
    """p_i, shape (C,)."""
    source: str
    """Where it came from: ``heuristic``, ``milp:<branch>``, ``enumeration``, ``minlp``."""
    used_gpus: int
    load: LoadModel | None
    """The dispatcher's load model of the expected batch on it (None: it cannot hold the batch)."""
    relaxed_makespan: float | None = None
    """The aggregated MILP's (or the heuristic's fluid) t̂."""
    lower_bound: float | None = float("inf")
    """LobRA's Theorem 1 bound (inf: the deployment cannot hold the longest sequence; None: not computed,
    for a polished or trimmed plan, which is never filtered); it compares plans in the filter, but is no
    bound on the makespan (see :func:`lower_bound`)."""
    survived: bool = True
    """Passed the lower-bound filter."""
    expected: Evaluation | None = None
    """Expected dispatch (survivors only)."""
    sampled_makespan: float | None = None
    """Mean makespan over the sampled batches (robust stage only)."""

    @property
    def expected_makespan(self) -> float:
        return self.expected.makespan if self.expected is not None else float("inf")


def evaluate(
    problem: PlanningProblem, load: LoadModel, *, exact: bool, options: PlannerOptions
) -> tuple[Evaluation, SolveResult | None]:
    """The best expected dispatch on ``load`` (a deployment's view of the expected batch): the
    dispatcher's fast balance, or its exact ILP bounded by it with the planner's solver settings
    (:func:`~lorafleet.dispatch.balance_load`, what a step runs), judged by the dispatcher's estimate
    of the step (:func:`class_times`; both balancers minimise the load model ``load.times``)."""
    balanced = _balanced(load, exact, options)
    times = class_times(problem, load, balanced.assignment.counts)
    evaluation = Evaluation(
        class_counts=balanced.assignment.counts, class_times=times, makespan=float(times.max()), method=balanced.method
    )
    return evaluation, balanced.result


def evaluate_below(
    problem: PlanningProblem, load: LoadModel, limit: float, options: PlannerOptions
) -> Evaluation | None:
    """:func:`evaluate`'s fast expected dispatch on ``load`` if its makespan is below ``limit``, else None.

    The load model's slowest class is priced first, alone, and then the others at once (one placement: each
    :func:`class_times` call places the whole deployment); the pricing stops at the first class at ``limit`` or
    slower, and within a class at its first replica above ``limit``: a deployment the caller would reject is mostly
    not priced whole (a class's time does not depend on which others are priced, :func:`class_times`, and a class
    with a replica above ``limit`` is rejected whatever the others' times). The slowest class settles most
    rejections alone (service-64: 55 of 62); priced one at a time, the others took service-128's 18 swaps rejected
    later 173 placements.
    """
    balanced = _balanced(load, False, options)
    counts = balanced.assignment.counts
    slowest = int(np.argmax(load.times(counts)))
    times = class_times(problem, load, counts, only=(slowest,), above=limit)
    if times[slowest] < limit and len(load.classes) > 1:
        others = tuple(k for k in range(len(load.classes)) if k != slowest)
        times[list(others)] = class_times(problem, load, counts, only=others, above=limit)[list(others)]
    if times.max() >= limit:
        return None
    return Evaluation(class_counts=counts, class_times=times, makespan=float(times.max()), method=balanced.method)


def _balanced(load: LoadModel, exact: bool, options: PlannerOptions) -> Balanced:
    """The dispatcher's balance of ``load`` with the planner's solver settings (a judged deployment);
    warns when the exact solve fell back to the fast answer."""
    count_work("deployments_judged")
    method = DispatchMethod.EXACT if exact else DispatchMethod.FAST
    settings = DispatchOptions(
        method=method, solver=options.solver, time_limit_s=options.time_limit_s, gap_rel=options.gap_rel
    )
    balanced = balance_load(load, settings)
    if balanced.fallback is not None:
        warnings.warn(balanced.fallback, SolverFallbackWarning, stacklevel=3)
    return balanced


def class_times(
    problem: PlanningProblem,
    load: LoadModel,
    counts: np.ndarray,
    only: tuple[int, ...] | None = None,
    above: float = float("inf"),
) -> np.ndarray:
    """(K,) the dispatcher's estimate of each class's slowest replica once class totals ``counts``
    of the expected batch are placed, cut into micro-batches and priced (``placed_work``); with
    ``only``, of those classes alone (the others 0); with ``above``, the pricing stops at the first replica
    above it (that class's time is then above ``above`` and at most its estimate, the later classes' 0)."""
    work = placed_work(
        problem.batch,
        load,
        counts,
        problem.cost_model,
        problem.policy.options.microbatch_mode,
        classes=only,
        window=problem.policy.pipeline_window,
        above=above,
    )
    return np.array([max(work[r][1] for r in c.replicas) for c in load.classes])


def pool_entry(
    problem: PlanningProblem, replicas: np.ndarray, source: str, relaxed: float | None = None, filtered: bool = True
) -> PoolEntry:
    """Deployment ``replicas`` as the planner first sees it: its load view of the expected batch and, when it
    will go through the Theorem-1 filter (``filtered``), its bound (a length-based balance)."""
    replicas = np.asarray(replicas, dtype=np.int64)
    used = int(replicas @ problem.gpus)
    if not problem.covers(replicas):
        return PoolEntry(
            replicas=replicas, source=source, used_gpus=used, load=None, relaxed_makespan=relaxed, survived=False
        )
    load, length_based = problem.plan_view(replicas, length_based=filtered)
    return PoolEntry(
        replicas=replicas,
        source=source,
        used_gpus=used,
        load=load,
        relaxed_makespan=relaxed,
        lower_bound=lower_bound(load, length_based) if length_based is not None else None,
    )
