"""First-improvement local search over deployments, judged by the dispatcher: the one loop behind the
makespan objective's polish (:func:`.refine.polished`, GPU-neutral swaps) and the cost objective's
refinement (:mod:`.cost_search`, one-replica moves).

From each start, the moves of the current deployment p are looked at in their order, each deployment
once (``seen``). A move p' has a bar t̄(p, p'), the slowest expected step at which it would still be
better than p (a makespan to beat, or the step at which p''s replicas cost as much a step as p's).
It is judged only when its LP bound (:func:`~lorafleet.dispatch.balance.fluid_bound`, no dispatch on p'
is faster) is below t̄, and then only up to t̄ (:func:`.evaluation.evaluate_below`); the LP is not solved where a
feasible split of it already lies below t̄ (:func:`.fluid_split.passes_fluid_bound`: the same decision). The first move
judged below its bar becomes p, and the search goes on from it until no move is better, or until the
budget (``options.polish_evaluations``, shared by all the starts) is spent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from enum import StrEnum

import numpy as np

from lorafleet.dispatch import fluid_bound
from lorafleet.planner.evaluation import PoolEntry, evaluate_below, pool_entry
from lorafleet.planner.fluid_split import passes_fluid_bound
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.problem import PlanningProblem

Moves = Callable[[np.ndarray], Iterable[tuple[np.ndarray, str]]]
"""The moves of a deployment p_i: each a deployment and how it came (``swap``, ``trim``, ``add``)."""

Bar = Callable[[PoolEntry, np.ndarray], float]
"""t̄(p, p'): the slowest expected step at which move p' would be kept over the current plan p."""


class Budget(StrEnum):
    """What ``options.polish_evaluations`` counts."""

    LOOKED = "looked"
    """Every move not seen before (the polish: its swaps are few, and most pass the LP bound)."""
    JUDGED = "judged"
    """Only the moves judged, past the LP bound (the cost search: most of its additions fail it)."""


def first_improvements(
    problem: PlanningProblem,
    starts: Sequence[PoolEntry],
    moves: Moves,
    bar: Bar,
    options: PlannerOptions,
    *,
    seen: set[tuple[int, ...]],
    budget: Budget,
) -> list[PoolEntry]:
    """The module doc's search from each of ``starts``: the improved plans (none when no move helps), each
    named ``<how>:<its start's source>``. ``seen`` (the deployments already judged) gains every move looked at."""
    limit, spent, found = options.polish_evaluations, 0, []
    for start in starts:
        current = start
        while spent < limit:
            better = None
            for replicas, how in moves(current.replicas):
                if spent >= limit:
                    break
                if tuple(replicas) in seen:
                    continue
                seen.add(tuple(replicas))
                if budget is Budget.LOOKED:
                    spent += 1
                slowest = bar(current, replicas)
                candidate = pool_entry(problem, replicas, f"{how}:{start.source}", filtered=False)
                if candidate.load is None:
                    continue  # it cannot hold the batch
                if not passes_fluid_bound(candidate.load, slowest) and fluid_bound(candidate.load) >= slowest:
                    continue  # no dispatch on it is fast enough (the LP's bound)
                if budget is Budget.JUDGED:
                    spent += 1
                expected = evaluate_below(problem, candidate.load, slowest, options)
                if expected is not None:
                    better = replace(candidate, expected=expected)
                    break
            if better is None:
                break
            current = better
        if current is not start:
            found.append(current)
    return found
