"""The search of the cost objective (``plan --objective cost``): the cheapest step, judged by the dispatcher.

1. **Proposals.** The sweep (:func:`.frontier.cost_sweep`) gives the model's cheapest deployment at each step
   time it solves, and the makespan MILP's fastest; the running deployment (a re-plan's incumbent) joins them.
   The model is a fluid one: the dispatcher's step is longer (ceil shares, whole micro-batches, the bubble), so
   under a step-time limit L the cheapest proposals whose judged step is past L are solved again at a T scaled
   down by how far the model was from the dispatcher on them (:data:`LIMIT_RETRIES` at most); when still none is
   judged within L, the makespan objective's search adds its plans (the fastest it finds, and the rest it judged).
2. **Judged** by the dispatcher on the expected batch (:func:`.evaluation.evaluate`), as every deployment the
   planner compares is; a deployment's cost a step is its judged makespan x c(p), what its replicas cost a
   second.
3. **Refined**: from the cheapest ``polish_starts``, a local search over one-replica moves (a replica removed,
   a replica traded for replicas of another config on the same number of GPUs, on any pool, or a replica
   added), first improvement: a move is kept when its step is cheaper by more than ``tie_rel`` and within L
   (and within the step-cost cap C, ``--max-cost``; with C alone, when it is faster by more than ``tie_rel`` and
   within C); ``polish_evaluations`` moves judged at most. A move whose LP bound (``dispatch.fluid_bound``) is
   already at the step time at which it would no longer beat the plan (its bar) is not judged, and the others only
   up to that step time (:func:`.evaluation.evaluate_below`).
4. **Ranked** by the objective (:func:`.objective.preferred` with the price, L and C): the cheapest step within L
   (and C), costs within ``tie_rel`` tied and the faster winning; with C alone the fastest step within C, makespans
   within ``tie_rel`` tied and the cheaper winning. The sweep spans the fastest step (the makespan MILP's) to the
   cheapest, so its judged points seed this search too. The robust race then runs on the best three.

The judged deployments give the cost frontier (:func:`frontier_of`: none faster and cheaper), which ``plan``
prints and the plan records.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner.evaluation import PoolEntry, evaluate, pool_entry
from lorafleet.planner.fallback import heuristic_deployment
from lorafleet.planner.frontier import CostSweep, cheapest_at, cost_sweep, pareto
from lorafleet.planner.local_search import Budget, first_improvements
from lorafleet.planner.objective import preferred
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.problem import PlanningProblem
from lorafleet.planner.refine import swaps
from lorafleet.plans import FrontierPoint
from lorafleet.solvers import SolveResult

LIMIT_RETRIES = 3
"""Under a step-time limit, the most extra cost MILPs solved below it (step 1 of the module doc)."""


def entry_cost(entry: PoolEntry, prices: np.ndarray) -> float:
    """What a step on ``entry`` costs: its judged makespan x what its replicas cost a second (inf: not judged)."""
    return entry.expected_makespan * float(entry.replicas @ prices) if entry.expected is not None else math.inf


def within_bounds(entry: PoolEntry, prices: np.ndarray, options: PlannerOptions) -> bool:
    """Whether ``entry``'s step is within the cost objective's bounds, each when given: its expected makespan within
    the step-time limit L (``options.max_step_s``) and its cost a step within the step-cost cap C
    (``options.max_step_cost``)."""
    limit, cap = options.max_step_s, options.max_step_cost
    return (limit is None or entry.expected_makespan <= limit) and (cap is None or entry_cost(entry, prices) <= cap)


def describe_replicas(problem: PlanningProblem, replicas: np.ndarray) -> str:
    """``<1,1>@h100 x 4 + <2,2>@h100 x 1``: as ``DeploymentPlan.describe`` writes the plan of ``replicas``."""
    order = {p.name: k for k, p in enumerate(problem.cluster.pools)}
    counts = [(c.config, int(n)) for c, n in zip(problem.candidates, replicas, strict=True) if n > 0]
    counts.sort(key=lambda item: (order.get(item[0].pool, len(order)), item[0]))
    return " + ".join(f"{c} x {n}" for c, n in counts)


def cost_search(
    problem: PlanningProblem,
    options: PlannerOptions,
    incumbent: PoolEntry | None = None,
    fastest: Callable[[], tuple[list[PoolEntry], tuple[SolveResult, ...]]] | None = None,
) -> tuple[list[PoolEntry], list[PoolEntry], tuple[SolveResult, ...], tuple[str, ...], bool]:
    """Steps 1-4 of the module doc. Returns every deployment considered, the judged ones ranked (the preferred
    first, then the others within the limit by cost, then the rest by makespan), the solves, notes, and whether
    the heuristic stands in for a solver that gave nothing.

    ``fastest``: the makespan objective's search (its judged plans and solves), run when a step-time limit is
    given and no proposal of the sweep is judged within it: the makespan MILP's deployment is only the sweep's
    fast end, and a limit near the fastest step needs the plans the makespan search finds (its branches and
    swaps; service-64 within 15.85 s: the sweep's fastest judged 18.1 s, the makespan search's 15.76 s)."""
    prices = problem.replica_prices
    assert prices is not None, "plan_deployment checks that every pool has a price"
    limit = options.max_step_s
    sweep = cost_sweep(
        problem, prices, limit=limit, solver=options.solver, time_limit_s=options.time_limit_s, tie_rel=options.tie_rel
    )
    solves = list(sweep.solves)
    notes = list(sweep.notes)
    pool: list[PoolEntry] = []
    seen: set[tuple[int, ...]] = set()

    def add(replicas: np.ndarray, source: str, relaxed: float | None = None) -> None:
        if tuple(replicas) in seen:
            return
        seen.add(tuple(replicas))
        entry = pool_entry(problem, replicas, source, relaxed, filtered=False)
        if entry.load is not None:
            entry = replace(entry, expected=evaluate(problem, entry.load, exact=False, options=options)[0])
        pool.append(entry)

    if sweep.fastest is not None:
        add(sweep.fastest.replicas, "milp:root", sweep.fastest.makespan)
    for point in sweep.points:
        add(point.replicas, f"sweep:{point.limit:.4g}s", point.makespan)
    fell_back = not any(e.expected is not None for e in pool)
    if fell_back:
        message = "the cost sweep gave no deployment that holds the batch; falling back to the heuristic plan"
        warnings.warn(message, SolverFallbackWarning, stacklevel=2)
        notes.append(message)
        replicas, fluid = heuristic_deployment(problem)
        add(replicas, "heuristic", fluid)
    if incumbent is not None:
        add(incumbent.replicas, "incumbent")
    if limit is not None:
        solves += _below_limit(problem, prices, pool, add, options, limit)
        if fastest is not None and not any(e.expected_makespan <= limit for e in pool):
            found, searched = fastest()
            solves += searched
            notes.append(
                f"no proposal of the sweep within the step-time limit: the makespan search's {len(found)} plans"
            )
            for entry in found:
                if tuple(entry.replicas) not in seen:
                    seen.add(tuple(entry.replicas))
                    pool.append(entry)

    judged = [e for e in pool if e.expected is not None]
    starts = ranked_by_cost(judged, prices, options)[: options.polish_starts]
    for entry in _polished(problem, starts, prices, options, limit, seen):
        pool.append(entry)
        judged.append(entry)
    ranked = ranked_by_cost(judged, prices, options)
    notes.append(_sweep_note(sweep))
    return pool, ranked, tuple(solves), tuple(notes), fell_back


def _sweep_note(sweep: CostSweep) -> str:
    solved = len(sweep.points)
    how = "every gap closed" if sweep.closed else f"stopped with the model's cheapest step >= {sweep.bound:.4g}"
    best = sweep.best
    found = f"; the model's cheapest {best.cost:.4g} a step at {best.makespan:.4g} s" if best is not None else ""
    return f"cost sweep: {solved} step times solved ({how}){found}"


def ranked_by_cost(entries: list[PoolEntry], prices: np.ndarray, options: PlannerOptions) -> list[PoolEntry]:
    """``entries`` the preferred first (:func:`~lorafleet.planner.objective.preferred` with the price, the limit
    ``options.max_step_s`` and the cap ``options.max_step_cost``), then those within both: by cost, or with the cap
    alone by makespan; then the others: by makespan, or with the cap alone by cost (the nearest to it first)."""
    limit, cap = options.max_step_s, options.max_step_cost
    speed = cap is not None and limit is None
    if not entries:
        return []

    def key(e: PoolEntry) -> tuple:
        cost, within = entry_cost(e, prices), within_bounds(e, prices, options)
        if speed:
            return (not within, e.expected_makespan, cost) if within else (True, cost, e.expected_makespan)
        return (not within, cost if within else e.expected_makespan, e.expected_makespan)

    best = preferred(
        entries,
        lambda e: e.expected_makespan,
        lambda e: e.used_gpus,
        options.tie_rel,
        lambda e: float(e.replicas @ prices),
        limit,
        cap,
    )
    return [best, *sorted((e for e in entries if e is not best), key=key)]


def _below_limit(problem, prices, pool, add, options: PlannerOptions, limit: float) -> list[SolveResult]:
    """Step 1's retries: while the cheapest judged proposal is past the limit and cheaper than every one within
    it, the cheapest deployment at T = L x its model step / its judged step, solved and judged."""
    solves: list[SolveResult] = []
    for _ in range(LIMIT_RETRIES):
        judged = [e for e in pool if e.expected is not None]
        within = [entry_cost(e, prices) for e in judged if e.expected_makespan <= limit]
        bar = min(within, default=math.inf)
        over = [e for e in judged if e.expected_makespan > limit and e.relaxed_makespan and entry_cost(e, prices) < bar]
        if not over:
            break
        worst = min(over, key=lambda e: entry_cost(e, prices))
        target = limit * worst.relaxed_makespan / worst.expected_makespan
        point, result = cheapest_at(problem, prices, target, solver=options.solver, time_limit_s=options.time_limit_s)
        solves.append(result)
        if point is None or tuple(point.replicas) in {tuple(e.replicas) for e in pool}:
            break
        add(point.replicas, f"sweep:{point.limit:.4g}s", point.makespan)
    return solves


def _moves(problem: PlanningProblem, replicas: np.ndarray, faster: bool = False) -> Iterator[tuple[np.ndarray, str]]:
    """A replica removed (the largest configs first; never the last one), traded
    (:func:`~lorafleet.planner.refine.swaps`), added; ``faster`` (the fastest step within a cap): added, traded,
    removed, the moves that can shorten the step first."""
    eye = np.eye(len(replicas), dtype=np.int64)

    def trims() -> Iterator[tuple[np.ndarray, str]]:
        for i in sorted(np.flatnonzero(replicas > 0), key=lambda i: (-int(problem.gpus[i]), i)):
            if replicas.sum() > 1:
                yield replicas - eye[i], "trim"

    def adds() -> Iterator[tuple[np.ndarray, str]]:
        for i in range(len(replicas)):
            grown = replicas + eye[i]
            if problem.fits(grown):
                yield grown, "add"

    trades = ((swapped, "swap") for swapped in swaps(problem, replicas))
    order = (adds(), trades, trims()) if faster else (trims(), trades, adds())
    for moves in order:
        yield from moves


def _polished(
    problem: PlanningProblem,
    starts: list[PoolEntry],
    prices: np.ndarray,
    options: PlannerOptions,
    limit: float | None,
    seen: set[tuple[int, ...]],
) -> list[PoolEntry]:
    """Step 3 of the module doc (:func:`~.local_search.first_improvements`): the improved plans found from
    ``starts`` (none when no move helps). A move p' of plan p is kept when its step is within the limit L and the
    cap C (``options.max_step_cost``: t̄ c(p') <= C) and better by more than ``tie_rel``: cheaper, with bar

        t̄ = min(cost(p) (1 - tie_rel) / c(p'), L, C / c(p')),

    or, with the cap alone (the fastest step within it), faster: t̄ = min(t(p) (1 - tie_rel), C / c(p')), and when p
    itself costs more than C any move within the cap is better: t̄ = C / c(p')."""
    cap = options.max_step_cost
    speed = cap is not None and limit is None
    exact = 1 + 1e-12

    def bar(current: PoolEntry, replicas: np.ndarray) -> float:
        price = float(replicas @ prices)
        capped = cap * exact / price if cap is not None and price > 0 else math.inf
        if speed:
            if entry_cost(current, prices) > cap:
                return capped
            return min(current.expected_makespan * (1 - options.tie_rel), capped)
        slowest = entry_cost(current, prices) * (1 - options.tie_rel) / price if price > 0 else math.inf
        return min(slowest, limit * exact, capped) if limit is not None else min(slowest, capped)

    return first_improvements(
        problem,
        starts,
        lambda replicas: _moves(problem, replicas, speed),
        bar,
        options,
        seen=seen,
        budget=Budget.JUDGED,
    )


def frontier_of(
    problem: PlanningProblem, entries: list[PoolEntry], chosen: PoolEntry | None = None
) -> tuple[FrontierPoint, ...]:
    """The cost frontier of the judged ``entries``: those no other is faster and cheaper than, fastest first; and
    the ``chosen`` plan in its place when it is not on it (the race on sampled batches may pick a plan that the
    expected batch puts a hair behind another of the same price)."""
    prices = problem.replica_prices
    assert prices is not None
    judged = [e for e in entries if e.expected is not None]
    points = pareto(judged, lambda e: e.expected_makespan, lambda e: entry_cost(e, prices))
    if chosen is not None and all(tuple(e.replicas) != tuple(chosen.replicas) for e in points):
        points = sorted([*points, chosen], key=lambda e: (e.expected_makespan, entry_cost(e, prices)))
    return tuple(
        FrontierPoint(
            makespan_s=e.expected_makespan,
            cost_per_step=entry_cost(e, prices),
            gpus=e.used_gpus,
            deployment=describe_replicas(problem, e.replicas),
        )
        for e in points
    )
