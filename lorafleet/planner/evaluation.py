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

from lorafleet.dispatch import LoadModel, balance_fast, placed_work, solve_dispatch_ilp
from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner.candidates import lower_bound
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.problem import PlanningProblem
from lorafleet.solvers import SolveResult, SolveStatus


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
    lower_bound: float = float("inf")
    """LobRA's Theorem 1 bound (inf: the deployment cannot hold the longest sequence); it compares
    plans in the filter, but is no bound on the makespan (see :func:`lower_bound`)."""
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
    dispatcher's fast balance, or its exact ILP bounded by it, judged by the dispatcher's estimate
    of the step (:func:`class_times`; both balancers minimise the load model ``load.times``)."""
    assignment, method, result = balance_fast(load), "fast", None
    if exact:
        outcome = solve_dispatch_ilp(
            load, options.solver, options.time_limit_s, options.gap_rel, upper_bound_s=assignment.makespan_s
        )
        result = outcome.result
        if outcome.assignment is not None:
            assignment, method = outcome.assignment, f"milp:{result}"
        else:
            method = f"milp:{result}->fast"
            warnings.warn(
                unusable_solve_note("the exact dispatch ILP", result, "the fast dispatch stands"),
                SolverFallbackWarning,
                stacklevel=2,
            )
    times = class_times(problem, load, assignment.counts)
    return Evaluation(
        class_counts=assignment.counts, class_times=times, makespan=float(times.max()), method=method
    ), result


_NO_SOLUTION = {
    SolveStatus.INFEASIBLE: "proved it infeasible",
    SolveStatus.UNBOUNDED: "found it unbounded",
    SolveStatus.FAILED: "found no solution (a solver error, or a limit reached before any solution)",
}


def unusable_solve_note(what: str, result: SolveResult, instead: str) -> str:
    """One line saying why ``what``'s solve gave nothing the caller can use, and what stands ``instead``.

    Built from both halves of ``result`` (its status and whether it carries a solution) so that they
    never contradict each other: a status that claims a solution whose values the caller could not use
    (``cbc returned no usable solution (status optimal, but its values were unusable; 0.12 s)``), values
    without a solution status, or a plain failure (``cbc proved it infeasible (0.12 s)``).
    """
    solver, status, wall = result.solver.value, result.status.value, f"{result.wall_s:.2f} s"
    if result.has_solution:
        said = f"{solver} returned no usable solution (status {status}, but its values were unusable; {wall})"
    elif result.objective is not None:
        said = f"{solver} returned values without a solution (status {status}; they are not used; {wall})"
    else:
        said = f"{solver} {_NO_SOLUTION.get(result.status, f'gave no solution (status {status})')} ({wall})"
    return f"{what}: {said}; {instead}"


def class_times(problem: PlanningProblem, load: LoadModel, counts: np.ndarray, only: int | None = None) -> np.ndarray:
    """(K,) the dispatcher's estimate of each class's slowest replica once class totals ``counts``
    of the expected batch are placed, cut into micro-batches and priced (``placed_work``); with
    ``only``, of that class alone (the others 0)."""
    work = placed_work(
        problem.batch,
        load,
        counts,
        problem.cost_model,
        problem.dispatch.microbatch_mode,
        classes=None if only is None else (only,),
    )
    return np.array([max(work[r][1] for r in c.replicas) for c in load.classes])


def pool_entry(problem: PlanningProblem, replicas: np.ndarray, source: str, relaxed: float | None = None) -> PoolEntry:
    replicas = np.asarray(replicas, dtype=np.int64)
    used = int(replicas @ problem.gpus)
    if not problem.covers(replicas):
        return PoolEntry(
            replicas=replicas, source=source, used_gpus=used, load=None, relaxed_makespan=relaxed, survived=False
        )
    load, length_based = problem.plan_view(replicas)
    return PoolEntry(
        replicas=replicas,
        source=source,
        used_gpus=used,
        load=load,
        relaxed_makespan=relaxed,
        lower_bound=lower_bound(load, length_based),
    )
