"""Find the deployment: candidate pool -> Theorem-1 filter -> expected dispatch -> exact re-solve.

Every deployment p is judged by the dispatcher's own load model on the expected batch's
planning buckets: the balanced class totals d_ij that minimise the slowest replica
(``balance_fast``, milliseconds), re-solved by the exact dispatch ILP for the best few
(``solve_dispatch_ilp``, bounded by the fast answer). That is LobRA's Eq. 1-3 for a fixed
p with every replica of a config taking ceil(d_ij / p_i) rows of bucket j (Eq. 12).

Where the pool comes from depends on the mode (``PlannerMode``): the aggregated MILP's k
best plus the heuristic (decomposed), every maximal deployment (exhaustive), or LobRA's
joint MINLP (joint-minlp). A solver that fails leaves the heuristic plan in the pool, with
a :class:`~lorafleet.errors.SolverFallbackWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from lorafleet.dispatch.balance import balance_fast
from lorafleet.dispatch.ilp import solve_dispatch_ilp
from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner.candidates import enumerate_deployments, has_distinct_max_tokens, lower_bound, lower_bound_filter
from lorafleet.planner.deployment_ilp import propose_deployments
from lorafleet.planner.fallback import heuristic_deployment
from lorafleet.planner.joint_minlp import JointSolution, solve_joint
from lorafleet.planner.options import PlannerMode, PlannerOptions
from lorafleet.planner.problem import PlanningProblem
from lorafleet.solvers import SolveResult

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Evaluation:
    """A deployment's expected dispatch on the planning buckets."""

    class_counts: np.ndarray
    """d_ij, shape (C, R): sequences of bucket j on config i, all its replicas together."""
    replica_time: np.ndarray
    """T_i of config i's slowest replica, shape (C,) (0 where not deployed)."""
    makespan: float
    """t̂ = max_i T_i (Eq. 1)."""
    method: str
    """``fast`` or the exact ILP's ``milp:<solver>:<status>``."""


@dataclass(kw_only=True, eq=False)
class PoolEntry:
    """One deployment the planner considered, with what it learnt about it."""

    replicas: np.ndarray
    """p_i, shape (C,)."""
    source: str
    """Where it came from: ``milp#k``, ``heuristic``, ``enumeration``, ``minlp``."""
    used_gpus: int
    relaxed_makespan: float | None = None
    """The aggregated MILP's t̂ (decomposed mode)."""
    lower_bound: float = float("inf")
    """LobRA's Theorem 1 bound."""
    survived: bool = True
    """Passed the lower-bound filter."""
    expected: Evaluation | None = None
    sampled_makespan: float | None = None
    """Mean makespan over the sampled batches (robust stage)."""

    @property
    def expected_makespan(self) -> float:
        return self.expected.makespan if self.expected is not None else float("inf")


@dataclass(kw_only=True)
class SearchOutcome:
    pool: list[PoolEntry]
    solves: list[SolveResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fell_back: bool = False
    """A solver failed and the heuristic stands in for it."""


def evaluate(problem: PlanningProblem, replicas: np.ndarray, *, exact: bool, options: PlannerOptions) -> tuple[Evaluation, SolveResult | None]:
    """Deployment p's best expected dispatch: the fast balance, or the exact ILP bounded by it."""
    load = problem.plan_load(replicas)
    deployed = np.flatnonzero(np.asarray(replicas) > 0)
    assignment, method, result = balance_fast(load), "fast", None
    if exact:
        outcome = solve_dispatch_ilp(load, options.solver, options.time_limit_s, options.gap_rel, upper_bound_s=assignment.makespan_s)
        result = outcome.result
        if outcome.assignment is not None:
            assignment, method = outcome.assignment, f"milp:{result}"
        else:
            method = f"milp:{result}->fast"
            warnings.warn(f"exact dispatch ILP gave no solution ({result}, {result.wall_s:.2f} s); "
                          f"the fast dispatch stands", SolverFallbackWarning, stacklevel=2)
    counts = np.zeros(problem.microbatch_size.shape, dtype=np.int64)
    counts[deployed] = assignment.counts
    times = np.zeros(len(problem.candidates))
    times[deployed] = load.times(assignment.counts)
    return Evaluation(class_counts=counts, replica_time=times, makespan=float(times.max()), method=method), result


def preferred(items: Sequence[T], makespan: Callable[[T], float], gpus: Callable[[T], int], tie_rel: float) -> T:
    """The fastest item, except that one within ``tie_rel`` of it on fewer GPUs wins (then the faster)."""
    best = min(makespan(x) for x in items)
    tied = [x for x in items if makespan(x) <= best * (1 + tie_rel)]
    return min(tied, key=lambda x: (gpus(x), makespan(x)))


def _entry(problem: PlanningProblem, replicas: np.ndarray, source: str, relaxed: float | None = None) -> PoolEntry:
    return PoolEntry(replicas=np.asarray(replicas, dtype=np.int64), source=source,
                     used_gpus=int(np.asarray(replicas) @ problem.gpus), relaxed_makespan=relaxed)


def _fallback(outcome: SearchOutcome, what: str, result: SolveResult) -> None:
    message = f"{what} gave no solution ({result}, {result.wall_s:.2f} s); falling back to the heuristic plan"
    warnings.warn(message, SolverFallbackWarning, stacklevel=3)
    outcome.notes.append(message)
    outcome.fell_back = True


def decomposed_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """The heuristic plan and the aggregated MILP's proposals, the Theorem-1 filter applied."""
    heuristic, horizon = heuristic_deployment(problem)
    outcome = SearchOutcome(pool=[_entry(problem, heuristic, "heuristic", horizon)])
    found, outcome.solves = propose_deployments(problem, horizon, tie_rel=options.tie_rel, solver=options.solver,
                                                time_limit_s=options.time_limit_s)
    if not found:
        _fallback(outcome, "the deployment MILP", outcome.solves[-1])
    seen = {tuple(heuristic)}
    for plan in found:
        if tuple(plan.replicas) not in seen:
            seen.add(tuple(plan.replicas))
            outcome.pool.append(_entry(problem, plan.replicas, f"milp:{plan.branch}", plan.makespan))
    for entry in outcome.pool:
        entry.lower_bound = lower_bound(problem, entry.replicas)
    kept = set(lower_bound_filter([e.lower_bound for e in outcome.pool],
                                  [has_distinct_max_tokens(problem, e.replicas) for e in outcome.pool],
                                  options.lower_bound_threshold, options.min_survivors))
    for k, entry in enumerate(outcome.pool):
        entry.survived = k in kept and np.isfinite(entry.lower_bound)
    return outcome


def exhaustive_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """Every maximal deployment (no filter: this is the reference the others are checked against)."""
    pool = [_entry(problem, p, "enumeration") for p in enumerate_deployments(problem, options.enumeration_limit)]
    for entry in pool:
        entry.lower_bound = lower_bound(problem, entry.replicas)
    return SearchOutcome(pool=pool)


def minlp_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """LobRA's joint MINLP on SCIP; the heuristic plan if it gives nothing."""
    solution = solve_joint(problem, time_limit_s=options.time_limit_s, gap_rel=min(options.gap_rel, 1e-4))
    if isinstance(solution, JointSolution):
        entry = _entry(problem, solution.replicas, "minlp", solution.makespan)
        outcome = SearchOutcome(pool=[entry], solves=[solution.solve])
    else:
        outcome = SearchOutcome(pool=[_entry(problem, heuristic_deployment(problem)[0], "heuristic")], solves=[solution])
        _fallback(outcome, "the joint MINLP", solution)
    for entry in outcome.pool:
        entry.lower_bound = lower_bound(problem, entry.replicas)
    return outcome


POOLS: dict[PlannerMode, Callable[[PlanningProblem, PlannerOptions], SearchOutcome]] = {
    PlannerMode.DECOMPOSED: decomposed_pool,
    PlannerMode.EXHAUSTIVE: exhaustive_pool,
    PlannerMode.JOINT_MINLP: minlp_pool,
}


def search(problem: PlanningProblem, options: PlannerOptions) -> tuple[SearchOutcome, list[PoolEntry]]:
    """The pool of ``options.mode`` and the expected dispatch of its survivors, best first.

    Every survivor gets the fast expected dispatch; the best ``exact_top`` are then
    re-solved by the exact dispatch ILP.
    """
    outcome = POOLS[options.mode](problem, options)
    for entry in outcome.pool:
        if entry.survived:
            entry.expected, _ = evaluate(problem, entry.replicas, exact=False, options=options)
    ranked = sorted((e for e in outcome.pool if e.expected is not None), key=lambda e: (e.expected_makespan, e.used_gpus))
    for entry in ranked[: options.exact_top]:
        entry.expected, result = evaluate(problem, entry.replicas, exact=True, options=options)
        outcome.solves.append(result)
    ranked.sort(key=lambda e: (e.expected_makespan, e.used_gpus))
    return outcome, ranked
