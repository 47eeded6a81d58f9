"""Find the deployment: candidate pool -> Theorem-1 filter -> expected dispatch -> exact re-solve.

Each deployment is judged by the dispatcher (:mod:`.evaluation`), refined (:mod:`.refine`)
and ranked by the objective (:mod:`.objective`).

Where the pool comes from depends on the mode (``PlannerMode``): the aggregated MILP's k
best plus the heuristic (decomposed), every maximal deployment (exhaustive), or LobRA's
joint MINLP (joint-minlp). A solver that fails leaves the heuristic plan in the pool, with
a :class:`~lorafleet.errors.SolverFallbackWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner.candidates import enumerate_deployments, has_distinct_max_tokens, lower_bound_filter
from lorafleet.planner.cost_search import cost_search, ranked_by_cost
from lorafleet.planner.deployment_ilp import branch_deployments, solve_root
from lorafleet.planner.evaluation import PoolEntry, evaluate, pool_entry
from lorafleet.planner.fallback import heuristic_deployment
from lorafleet.planner.objective import preferred, replica_price
from lorafleet.planner.options import PlannerMode, PlannerOptions, PlanObjective
from lorafleet.planner.problem import PlanningProblem
from lorafleet.planner.refine import polish_starts, polished, trimmed
from lorafleet.solvers import SolveResult


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOutcome:
    """Every deployment considered and what the solvers said."""

    pool: tuple[PoolEntry, ...]
    """Judged ones first, best first (the preferred plan leads); filtered-out ones last."""
    solves: tuple[SolveResult, ...] = ()
    notes: tuple[str, ...] = ()
    fell_back: bool = False
    """A solver failed and the heuristic stands in for it (a SolverFallbackWarning was issued)."""


def _fallback_note(what: str, result: SolveResult) -> str:
    """Warn that ``what`` gave nothing usable and the heuristic plan stands in; the note for the plan."""
    message = result.unusable_note(what, "falling back to the heuristic plan")
    warnings.warn(message, SolverFallbackWarning, stacklevel=3)
    return message


def _filter(problem: PlanningProblem, pool: Sequence[PoolEntry], options: PlannerOptions) -> list[PoolEntry]:
    """LobRA's Theorem-1 filter over the whole pool; a dropped entry stays dropped."""
    kept = set(
        lower_bound_filter(
            [e.lower_bound for e in pool],
            [has_distinct_max_tokens(problem, e.replicas) for e in pool],
            options.lower_bound_threshold,
            options.min_survivors,
        )
    )
    return [replace(e, survived=e.survived and k in kept) for k, e in enumerate(pool)]


def _evaluate_survivors(
    problem: PlanningProblem, pool: Sequence[PoolEntry], options: PlannerOptions
) -> list[PoolEntry]:
    return [
        replace(e, expected=evaluate(problem, e.load, exact=False, options=options)[0])
        if e.survived and e.expected is None
        else e
        for e in pool
    ]


def decomposed_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """The decomposed search (``_decomposed_search``), run again on the configs without
    activation recomputation when the candidates mix both, its plans judged in the full problem.

    Recomputing variants double the candidates; the MILP-guided branching then explores a
    larger space in the same rounds and can miss a plan it finds when they are absent (2 of
    20 random 7B workloads, +2.9%). Searching the plain sub-problem too means allowing
    recomputation never yields a worse expected plan than forbidding it.
    """
    outcome = _decomposed_search(problem, options)
    plain = [i for i, c in enumerate(problem.candidates) if not c.config.recompute]
    mixed = 0 < len(plain) < len(problem.candidates)
    if not mixed or max(problem.candidates[i].max_tokens for i in plain) < problem.batch.lengths.max():
        return outcome  # nothing to compare with, or no plain config holds the longest sequence
    sub = problem.restricted(plain)
    sub_outcome = _decomposed_search(sub, options)
    pool, seen = list(outcome.pool), {tuple(e.replicas) for e in outcome.pool}
    for entry in sub_outcome.pool:
        replicas = np.zeros(len(problem.candidates), dtype=np.int64)
        replicas[plain] = entry.replicas
        if tuple(replicas) not in seen:
            seen.add(tuple(replicas))
            # Its load view and evaluation depend only on the deployed configs, not on the problem's
            # planning buckets: kept as judged, re-filtered against the whole pool's bound.
            pool.append(
                replace(entry, replicas=replicas, source=f"plain:{entry.source}", survived=entry.load is not None)
            )
    return SearchOutcome(
        pool=tuple(_evaluate_survivors(problem, _filter(problem, pool, options), options)),
        solves=(*outcome.solves, *sub_outcome.solves),
        notes=(*outcome.notes, *sub_outcome.notes),
        fell_back=outcome.fell_back and sub_outcome.fell_back,
    )


def _decomposed_search(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """The heuristic plan, the aggregated MILP's optimum and branch optima around the best plan so far.

    Round r: branches around the center (the MILP's optimum at first, then the plan the
    dispatcher judges best), the Theorem-1 filter over everything found, the survivors
    evaluated. The search stops when the best plan beats the center by no more than the tie
    tolerance, or after ``search_rounds`` rounds: the MILP ignores fragments and ceil(d / p),
    so its optimum is a good start, not always the end.
    """
    heuristic, heuristic_fluid = heuristic_deployment(problem)
    pool = [pool_entry(problem, heuristic, "heuristic", heuristic_fluid)]
    root, solves = solve_root(
        problem, tie_rel=options.tie_rel, solver=options.solver, time_limit_s=options.time_limit_s
    )
    if root is None:
        note = _fallback_note("the deployment MILP", solves[-1])
        return SearchOutcome(
            pool=tuple(_evaluate_survivors(problem, pool, options)), solves=tuple(solves), notes=(note,), fell_back=True
        )
    seen = {tuple(heuristic)}

    def add(replicas: np.ndarray, source: str, relaxed: float) -> None:
        if tuple(replicas) not in seen:
            seen.add(tuple(replicas))
            pool.append(pool_entry(problem, replicas, source, relaxed))

    add(root.replicas, "milp:root", root.makespan)
    center, solved = root.replicas, set()
    for _ in range(options.search_rounds):
        found, results = branch_deployments(
            problem,
            center,
            root.makespan,
            tie_rel=options.tie_rel,
            solver=options.solver,
            time_limit_s=options.time_limit_s,
            max_branches=options.pool_size - 1,
            solved=solved,
        )
        solves.extend(results)
        for plan in found:
            add(plan.replicas, f"milp:{plan.branch}", plan.makespan)
        pool = _evaluate_survivors(problem, _filter(problem, pool, options), options)
        best = _preferred_entry(problem, [e for e in pool if e.expected is not None], options)
        at_center = next(e for e in pool if tuple(e.replicas) == tuple(center))
        if best.expected_makespan >= at_center.expected_makespan * (1 - options.tie_rel):
            break
        center = best.replicas
    return SearchOutcome(pool=tuple(pool), solves=tuple(solves))


def exhaustive_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """Every maximal deployment (no filter: this is the reference the others are checked against); under the
    cost objective every deployment, maximal or not (GPUs not held cost nothing)."""
    maximal = options.objective is not PlanObjective.COST
    return SearchOutcome(
        pool=tuple(
            pool_entry(problem, p, "enumeration", filtered=maximal)
            for p in enumerate_deployments(problem, options.enumeration_limit, maximal)
        )
    )


def minlp_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """LobRA's joint MINLP on SCIP; the heuristic plan if it gives nothing."""
    from lorafleet.planner.joint_minlp import JointSolution, solve_joint  # its mode alone: not every plan's import

    solution = solve_joint(problem, time_limit_s=options.time_limit_s, gap_rel=min(options.gap_rel, 1e-4))
    if isinstance(solution, JointSolution):
        return SearchOutcome(
            pool=(pool_entry(problem, solution.replicas, "minlp", solution.makespan),), solves=(solution.solve,)
        )
    note = _fallback_note("the joint MINLP", solution)
    return SearchOutcome(
        pool=(pool_entry(problem, heuristic_deployment(problem)[0], "heuristic"),),
        solves=(solution,),
        notes=(note,),
        fell_back=True,
    )


POOLS: dict[PlannerMode, Callable[[PlanningProblem, PlannerOptions], SearchOutcome]] = {
    PlannerMode.DECOMPOSED: decomposed_pool,
    PlannerMode.EXHAUSTIVE: exhaustive_pool,
    PlannerMode.JOINT_MINLP: minlp_pool,
}


def search(problem: PlanningProblem, options: PlannerOptions) -> tuple[SearchOutcome, list[PoolEntry]]:
    """The pool of ``options.mode`` and its survivors with their expected dispatch, best first.

    Every survivor gets the fast expected dispatch; the best ``exact_top`` are then
    re-solved by the exact dispatch ILP. In decomposed mode the best ``polish_starts`` are
    polished by GPU-neutral swaps (:func:`polished`). The preferred one (least expected
    makespan, or within ``tie_rel`` of it on fewer GPUs) is also offered with idle replicas
    trimmed (:func:`trimmed`); the list returned starts with the preferred plan, then the others
    by expected makespan. The cost objective searches its own way (:func:`_search_cost`).
    """
    if options.objective is PlanObjective.COST:
        return _search_cost(problem, options)
    outcome = POOLS[options.mode](problem, options)
    incumbent = _incumbent(problem, options)
    if incumbent is not None and not any(np.array_equal(e.replicas, incumbent.replicas) for e in outcome.pool):
        outcome = replace(outcome, pool=(*outcome.pool, incumbent))
    pool = _evaluate_survivors(problem, outcome.pool, options)
    solves = list(outcome.solves)
    ranked = sorted((e for e in pool if e.expected is not None), key=lambda e: (e.expected_makespan, e.used_gpus))
    for k, entry in enumerate(ranked[: options.exact_top]):
        expected, result = evaluate(problem, entry.load, exact=True, options=options)
        ranked[k] = replace(entry, expected=expected)
        solves.append(result)
    if options.mode is PlannerMode.DECOMPOSED:
        ranked.extend(polished(problem, polish_starts(problem, ranked, options.polish_starts), ranked, options))
        ranked.sort(key=lambda e: (e.expected_makespan, e.used_gpus))
    if ranked:
        start = _preferred_entry(problem, ranked, options)
        trims = [trimmed(problem, start, options)]
        ranked.extend(t for t in trims if t is not None)
        ranked.sort(key=lambda e: (e.expected_makespan, e.used_gpus))
        best = _preferred_entry(problem, ranked, options)
        ranked = [best, *(e for e in ranked if e is not best)]
    pool = ranked + [e for e in pool if e.expected is None]
    return replace(outcome, pool=tuple(pool), solves=tuple(solves)), ranked


def _search_cost(problem: PlanningProblem, options: PlannerOptions) -> tuple[SearchOutcome, list[PoolEntry]]:
    """:func:`search` under the cost objective: the sweep, judging and moves of ``planner.cost_search`` (decomposed
    mode), or every deployment judged (exhaustive); ranked the preferred first, then by cost within the limit."""
    incumbent = _incumbent(problem, options)
    if options.mode is PlannerMode.DECOMPOSED:

        def fastest() -> tuple[list[PoolEntry], tuple[SolveResult, ...]]:
            makespan = replace(options, objective=PlanObjective.MAKESPAN, max_step_s=None, max_step_cost=None)
            outcome, judged = search(problem, makespan)
            return judged, outcome.solves

        pool, ranked, solves, notes, fell_back = cost_search(problem, options, incumbent, fastest)
        unjudged = [e for e in pool if e.expected is None]
        return SearchOutcome(pool=(*ranked, *unjudged), solves=solves, notes=notes, fell_back=fell_back), ranked
    outcome = POOLS[options.mode](problem, options)
    if incumbent is not None and not any(np.array_equal(e.replicas, incumbent.replicas) for e in outcome.pool):
        outcome = replace(outcome, pool=(*outcome.pool, incumbent))
    pool = _evaluate_survivors(problem, outcome.pool, options)
    prices = problem.replica_prices
    assert prices is not None
    ranked = ranked_by_cost([e for e in pool if e.expected is not None], prices, options)
    return replace(outcome, pool=(*ranked, *(e for e in pool if e.expected is None))), ranked


def _incumbent(problem: PlanningProblem, options: PlannerOptions) -> PoolEntry | None:
    """The running deployment (``options.incumbent``) as a pool entry; None without one, or when one of
    its configs is not a candidate of this problem."""
    if not options.incumbent:
        return None
    counts = np.zeros(len(problem.candidates), dtype=np.int64)
    configs = [c.config for c in problem.candidates]
    for config, n in options.incumbent:
        if config not in configs:
            return None
        counts[configs.index(config)] += n
    return pool_entry(problem, counts, "incumbent")


def _preferred_entry(problem: PlanningProblem, entries: list[PoolEntry], options: PlannerOptions) -> PoolEntry:
    price = replica_price(problem, options)
    return preferred(
        entries,
        lambda e: e.expected_makespan,
        lambda e: e.used_gpus,
        options.tie_rel,
        None if price is None else lambda e: price(e.replicas),
    )
