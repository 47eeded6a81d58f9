"""The planner's objective: which of several deployments is the better plan.

Every stage of the planner that compares deployments (the search around the MILP's optimum,
the polish and trim of the best plans, the robust race on sampled batches and the final pick)
ranks them with :func:`preferred`, the one function that states the objective. (The
baselines are built by their own papers' rule, fewest GPU-seconds on one config:
``baselines.best_homogeneous``.) Their makespans come from the dispatcher itself:

- on the expected batch (search): ``dispatch.placed_work`` on the balance of its bucket
  totals (``evaluation.evaluate``), K = 1, B_1 = E[B];
- on K sampled global batches (robust race, :func:`race`): every step dispatched by
  ``dispatch_step`` as training will dispatch it (``Schedule.step_cost``).

The aggregated MILP's objective (``deployment_ilp.objective``: max throughput θ' minus a
per-GPU tie weight, a fluid model without ceil(d/p), fragments or micro-batches) is only a
surrogate that proposes deployments; it never decides between them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.planner.options import PlannerOptions, PlanObjective
from lorafleet.planner.problem import PlanningProblem
from lorafleet.planner.schedule import Schedule
from lorafleet.plans import GlobalBatch
from lorafleet.work import count as count_work

T = TypeVar("T")


def preferred(
    items: Sequence[T],
    makespan: Callable[[T], float],
    gpus: Callable[[T], int],
    tie_rel: float,
    price: Callable[[T], float] | None = None,
    limit: float | None = None,
    cap: float | None = None,
) -> T:
    """The plan the planner prefers among ``items``: the objective, in one place.

    With t̄(p) the dispatcher's mean makespan of deployment p over the batches it was judged on,

        t̄(p) = (1/K) Σ_k max_r T_r(D(B_k, p))          (LobRA Eq. 1, averaged over K batches)

    where D is the per-step dispatch under the plan's policy and T_r the cost model's time of
    replica r's placed micro-batches, and N(p) its GPUs, the preferred plan is

        p* = argmin_lex { (N(p), t̄(p)) : t̄(p) <= (1 + ε) min_q t̄(q) },   ε = ``tie_rel``

    the fastest plan, except that one within ε of it on fewer GPUs wins (GPU-seconds per step
    fall by more than the step time rises), then the faster of those. With ``price`` (``--objective
    cost``: c(p), what plan p's replicas cost a second at their pools' prices, Σ_i p_i c_i) the plans within the
    step-time limit L (``limit``, ``--step-limit``) and the step-cost cap C (``cap``, ``--max-cost`` over the
    job's steps), each when given, are

        Q = { p : t̄(p) <= L, t̄(p) c(p) <= C }

    and without a cap, or with both bounds, the cheapest step in Q wins, costs within ε of the least tied and the
    faster of those winning::

        p* = argmin_lex { (t̄(p), N(p)) : p in Q, t̄(p) c(p) <= (1 + ε) min_{q in Q} t̄(q) c(q) }

    With the cap alone (the dual: the fastest job a money budget buys), the fastest step in Q wins, makespans
    within ε tied and the cheaper of those winning, then the one on fewer GPUs::

        p* = argmin_lex { (t̄(p) c(p), N(p)) : p in Q, t̄(p) <= (1 + ε) min_{q in Q} t̄(q) }

    When no plan is in Q, the plan preferred without the cap is returned (the fastest when no plan is within L):
    the caller says which bound is missed.
    """
    if price is not None:
        within = [x for x in items if limit is None or makespan(x) <= limit]
        if not within:
            return min(items, key=lambda x: (makespan(x), gpus(x)))
        capped = [x for x in within if cap is None or makespan(x) * price(x) <= cap]
        if not capped:
            return preferred(items, makespan, gpus, tie_rel, price, limit)
        if cap is not None and limit is None:
            fastest = min(makespan(x) for x in capped)
            tied = [x for x in capped if makespan(x) <= fastest * (1 + tie_rel)]
            return min(tied, key=lambda x: (makespan(x) * price(x), gpus(x)))
        least = min(makespan(x) * price(x) for x in capped)
        tied = [x for x in capped if makespan(x) * price(x) <= least * (1 + tie_rel)]
        return min(tied, key=lambda x: (makespan(x), gpus(x)))
    best = min(makespan(x) for x in items)
    tied = [x for x in items if makespan(x) <= best * (1 + tie_rel)]
    return min(tied, key=lambda x: (gpus(x), makespan(x)))


def replica_price(problem: PlanningProblem, options: PlannerOptions) -> Callable[[np.ndarray], float] | None:
    """Under ``--objective cost``, what a deployment p (replica counts, shape (C,)) costs a second: Σ_i p_i c_i
    (``PlanningProblem.replica_prices``); None under the makespan objective."""
    if options.objective is not PlanObjective.COST:
        return None
    prices = problem.replica_prices
    assert prices is not None, "plan_deployment checks that every pool has a price"
    return lambda replicas: float(np.asarray(replicas, dtype=float) @ prices)


def race(
    schedules: Sequence[Schedule],
    sample: Callable[[int], GlobalBatch],
    n_batches: int,
    cost_model: CostModel,
    tie_rel: float,
    rung: int,
    prices: Sequence[float] | None = None,
    cap: float | None = None,
) -> list[np.ndarray]:
    """Makespans of each schedule on the sampled batches ``sample(0)``, ..., ``sample(n_batches - 1)``, dispatched
    step by step: successive halving.

    Every schedule sees the same batches in the same order. After each rung of ``rung``
    batches the schedules still in the race are ranked by :func:`preferred` on their mean so
    far and the worse half leaves; the race ends when one is left or the batches run out.
    With the defaults (three plans, rungs of 8, K = 32) that is 3 x 8 + 2 x 8 = 40 dispatches
    instead of 3 x 32, and a batch is drawn only when a rung reaches it (16 of the 32: drawing 64 or 128 tenants'
    sequences is ~5 ms a batch). ``prices``: what each schedule costs a second, under ``--objective cost``;
    ``cap``: the step-cost cap C of :func:`preferred` on the sampled means.
    """
    samples: list[list[float]] = [[] for _ in schedules]
    alive = list(range(len(schedules)))
    for start in range(0, n_batches, rung):
        if len(alive) == 1 and start > 0:
            break
        for batch in map(sample, range(start, min(start + rung, n_batches))):
            for k in alive:
                count_work("batches_raced")
                samples[k].append(schedules[k].step_cost(batch, cost_model).makespan_s)
        ranked = []
        rest = list(alive)
        while rest:
            best = preferred(
                rest,
                lambda k: float(np.mean(samples[k])),
                lambda k: schedules[k].max_gpus,
                tie_rel,
                None if prices is None else prices.__getitem__,
                cap=cap,
            )
            ranked.append(best)
            rest.remove(best)
        alive = ranked[: (len(ranked) + 1) // 2]
    return [np.asarray(s) for s in samples]
