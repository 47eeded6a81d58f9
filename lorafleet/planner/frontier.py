"""The cost frontier: the cheapest deployment at every step time (``plan --objective cost``).

A provider that rents GPUs by the hour pays, per step, the step's makespan t(p) times what the deployed
replicas cost a second, c(p) = Σ_i p_i c_i (c_i: config i's GPUs x its pool's price per GPU-hour / 3600;
``PlanningProblem.replica_prices``). GPUs it does not hold cost nothing, so the cheapest step is

    min_p  t(p) c(p)   over every deployment p that fits the pools' GPUs (any subset of them),
                       with t(p) <= L when a step-time limit L is given,

a ratio objective (steps per currency unit, θ(p) / c(p), is the ratio maximised).

**The model.** In the aggregated model of :mod:`.deployment_ilp` (fluid dispatch of the planning buckets, w_ij
seconds a sequence of bucket j on config i in full micro-batches, a fixed time a_i a replica: overhead and
bubble) deployment p reaches the step time ``t(p) = min T s.t. Σ_i x_ij = D_j, Σ_j w_ij x_ij <= p_i (T - a_i)``
(:func:`fluid_makespan`, an LP once p is fixed). At a *fixed* T the constraints are linear in (p, x), so the
cheapest deployment that reaches T is one MILP, exact in the model (no linearisation of a_i θ, no fixed point)::

    c*(T) = min Σ_i c_i p_i   s.t.  Σ_i x_ij = D_j,   Σ_j w_ij x_ij <= p_i (T - a_i),   GPU budget rows on p

(:func:`cheapest_at`). c*(T) is a non-increasing step function, and the model's cheapest step is
F* = min_T T c*(T), reached where c* steps down: at t(p) of the deployment p that solves some c*(T).

**The sweep** (:func:`cost_sweep`, a branch and bound over log T, the parametric alternative to Dinkelbach's
ratio iteration, whose subproblem max θ - λ c(p) keeps the bilinear p_i θ). A solve at T gives p with
t(p) <= T and c(p) = c*(T); c* is c(p) on the whole of [t(p), T], where F rises with T. So between two solves
T_a < T_b (answers p_a, p_b) only (T_a, t(p_b)) is unknown, and since c* >= c(p_b) there,
F > T_a c(p_b) on it: a gap whose bound is within ``rel`` of the best F found is closed, the others are split
at their geometric middle, the lowest bound first. The sweep starts from the fastest deployment the
makespan MILP finds (``solve_root``: T_fast) and from T_R = min(L, F / c_lb), beyond which no deployment can
be cheaper (c_lb: the cheapest replica that holds the longest sequence, which every deployment needs). It
stops when no gap is open (F* found within ``rel``) or after ``max_solves`` MILPs. Every deployment it
solves is a point of the model's frontier (t(p), t(p) c(p)); the planner judges them by the dispatcher
(:mod:`.cost_search`), as it judges the makespan MILP's proposals.

:func:`pareto` keeps the points no other point beats on both step time and cost: the frontier ``plan``
prints and the report plots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import pulp

from lorafleet.planner.deployment_ilp import MILP_GAP_REL, fixed_time, modelled_configs, solve_root
from lorafleet.planner.problem import PlanningProblem
from lorafleet.solvers import SolveResult, SolverName, solve, solve_lp

SWEEP_REL = 1e-2
"""The sweep closes a gap whose lower bound is within this fraction of the cheapest step found: the model
only proposes deployments for the dispatcher to judge, and 1 % is finer than their difference there."""
SWEEP_SOLVES = 16
"""At most this many cost MILPs a sweep (the examples close every gap in 4-9)."""
GRID_RATIO = 1.25
GRID_POINTS = 8
"""The sweep first solves a geometric grid over [T_fast, T_R], points at most this ratio apart and at most this
many, so that the frontier is drawn over the whole range before the bound refines it."""
SPAN = 64.0
"""Where no price bounds the sweep (a pool at price 0), it reaches at most this multiple of T_fast."""

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SweepPoint:
    """One cost MILP's answer: the cheapest deployment that reaches ``limit`` in the model."""

    limit: float
    """T, seconds: the step time the MILP was solved at."""
    replicas: np.ndarray
    """p, shape (C,)."""
    price: float
    """c(p) = c*(T): what its replicas cost a second."""
    makespan: float
    """t(p) <= T: the model's step time of p (:func:`fluid_makespan`)."""

    @property
    def cost(self) -> float:
        """t(p) c(p): the model's cost of a step on p."""
        return self.makespan * self.price


@dataclass(frozen=True, kw_only=True, slots=True)
class CostSweep:
    """What a sweep found: its answers in the order solved, the MILPs' results, and how it ended."""

    points: tuple[SweepPoint, ...]
    solves: tuple[SolveResult, ...] = ()
    fastest: SweepPoint | None = None
    """The makespan MILP's deployment (T_fast); None when that MILP gave none."""
    closed: bool = False
    """Every gap closed: the model's cheapest step is within ``rel`` of :attr:`best`'s."""
    bound: float = 0.0
    """A lower bound on the model's cost of a step over T in the swept range (the least open gap's bound,
    or the best when all are closed)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def best(self) -> SweepPoint | None:
        """The cheapest point (of those within the limit the sweep was given)."""
        return min(self.points, key=lambda p: (p.cost, p.makespan), default=None)


def fluid_makespan(problem: PlanningProblem, replicas: np.ndarray) -> float:
    """t(p): the least step time of deployment ``replicas`` in the aggregated model (module doc), an LP over
    the split of the buckets; inf when its configs cannot hold every non-empty bucket or the LP fails."""
    replicas = np.asarray(replicas, dtype=np.int64)
    present = np.flatnonzero(problem.counts > 0)
    b = problem.microbatch_size
    deployed = [i for i in range(len(replicas)) if replicas[i] > 0 and (b[i, present] > 0).any()]
    pairs = [(i, int(j)) for i in deployed for j in present if b[i, j] > 0]
    if not pairs or any(not any(j == jj for _, jj in pairs) for j in present):
        return math.inf
    w, fixed, counts = problem.amortised_time, fixed_time(problem), problem.counts
    n = len(pairs) + 1  # y_ij (share of bucket j on config i), then τ
    a_eq = np.zeros((len(present), n))
    a_ub = np.zeros((len(deployed), n))
    a_ub[:, -1] = -1.0
    row_of_bucket = {int(j): r for r, j in enumerate(present)}
    row_of_config = {i: r for r, i in enumerate(deployed)}
    for k, (i, j) in enumerate(pairs):
        a_eq[row_of_bucket[j], k] = 1.0
        a_ub[row_of_config[i], k] = w[i, j] * counts[j] / replicas[i]
    cost = np.zeros(n)
    cost[-1] = 1.0
    x = solve_lp(cost, a_ub, -fixed[deployed], a_eq, np.ones(len(present)))
    return float(x[-1]) if x is not None else math.inf


def cheapest_at(
    problem: PlanningProblem, prices: np.ndarray, limit: float, *, solver: SolverName, time_limit_s: float
) -> tuple[SweepPoint | None, SolveResult]:
    """c*(T) at T = ``limit`` (module doc): the cheapest deployment at ``prices`` (c_i, shape (C,)) that reaches
    ``limit`` in the model; None when none does (or the solve gives nothing)."""
    model = pulp.LpProblem("cheapest", pulp.LpMinimize)
    fixed, w, counts = fixed_time(problem), problem.amortised_time, problem.counts
    limits = problem.max_replicas()
    scale = float(prices.max()) if prices.max() > 0 else 1.0
    present = np.flatnonzero(counts > 0)
    share: dict[tuple[int, int], pulp.LpVariable] = {}
    n_replicas: dict[int, pulp.LpVariable] = {}
    for i in modelled_configs(problem):
        name = problem.candidates[i].config.name
        room = 1.0 - fixed[i] / limit
        if room <= 0:
            continue  # its fixed time alone is past T: no replica of it reaches T
        p = model.add_variable(f"n_replicas[{name}]", lowBound=0, upBound=int(limits[i]), cat=pulp.LpInteger)
        n_replicas[i] = p
        work = []
        for j in present:
            if problem.microbatch_size[i, j] > 0:
                y = model.add_variable(f"share[{name}_bucket_{j}]", lowBound=0)
                share[i, int(j)] = y
                work.append((y, float(w[i, j] * counts[j] / limit)))
        model += (pulp.LpAffineExpression(work) <= room * p, f"capacity[{name}]")
    for j in present:
        model += (pulp.lpSum(y for (_, jj), y in share.items() if jj == j) == 1, f"cover[bucket_{j}]")

    rows, caps = problem.gpu_budget_rows()
    for r, (row, cap) in enumerate(zip(rows, caps)):
        model += (pulp.lpSum(int(row[i]) * p for i, p in n_replicas.items() if row[i]) <= int(cap), f"gpus_row_{r}")
    model.setObjective(pulp.lpSum(float(prices[i] / scale) * p for i, p in n_replicas.items()))
    result = solve(model, solver, time_limit_s=time_limit_s, gap_rel=MILP_GAP_REL, threads=1)
    if not result.has_solution or not n_replicas:
        return None, result
    replicas = np.zeros(len(problem.candidates), dtype=np.int64)
    for i, p in n_replicas.items():
        replicas[i] = int(round(p.value() or 0.0))
    makespan = fluid_makespan(problem, replicas)
    if not math.isfinite(makespan):
        return None, result
    point = SweepPoint(limit=limit, replicas=replicas, price=float(replicas @ prices), makespan=makespan)
    return point, result


def least_price(problem: PlanningProblem, prices: np.ndarray) -> float:
    """c_lb: the cheapest replica that holds the longest non-empty bucket; every deployment has one."""
    longest = int(np.flatnonzero(problem.counts > 0).max())
    holders = np.flatnonzero(problem.microbatch_size[:, longest] > 0)
    return float(prices[holders].min()) if holders.size else math.inf


def cost_sweep(
    problem: PlanningProblem,
    prices: np.ndarray,
    *,
    limit: float | None = None,
    solver: SolverName = SolverName.CBC,
    time_limit_s: float = 10.0,
    rel: float = SWEEP_REL,
    max_solves: int = SWEEP_SOLVES,
    tie_rel: float = 5e-3,
) -> CostSweep:
    """The branch and bound over the step time T of the module doc: the model's cheapest step within ``rel``,
    with t <= ``limit`` when given, and every deployment solved on the way (each a frontier point).

    Args:
        prices: c_i, what a replica of each candidate costs a second (shape (C,)).
        limit: L, the step-time limit, seconds (None: none).
        max_solves: the most cost MILPs (the makespan MILP's fixed point that finds T_fast is extra).
        tie_rel: the makespan MILP's tie weight (``PlannerOptions.tie_rel``).
    """
    root, solves = solve_root(problem, tie_rel=tie_rel, solver=solver, time_limit_s=time_limit_s)
    notes: list[str] = []
    if root is None:
        return CostSweep(points=(), solves=tuple(solves), notes=("the makespan MILP gave no deployment",))
    t_fast = fluid_makespan(problem, root.replicas)
    if not math.isfinite(t_fast):
        return CostSweep(points=(), solves=tuple(solves), notes=("the makespan MILP's deployment holds no step",))
    fastest = SweepPoint(limit=t_fast, replicas=root.replicas, price=float(root.replicas @ prices), makespan=t_fast)
    solved: dict[float, SweepPoint | None] = {}  # T -> the answer there

    def at(t: float) -> SweepPoint | None:
        point, result = cheapest_at(problem, prices, t, solver=solver, time_limit_s=time_limit_s)
        solves.append(result)
        solved[t] = point
        return point

    def within(p: SweepPoint) -> bool:
        return limit is None or p.makespan <= limit * (1 + 1e-9)

    def best_cost() -> float:
        costs = [p.cost for p in (fastest, *[q for q in solved.values() if q is not None]) if within(p)]
        return min(costs, default=math.inf)

    c_lb = least_price(problem, prices)
    if limit is not None and limit < t_fast:
        at(limit)  # the model's fastest is past the limit: its cheapest answer there, if any, says so
        notes.append(f"the step-time limit {limit:.4g} s is below the model's fastest deployment ({t_fast:.4g} s)")
    else:
        at(t_fast * (1 + 1e-9))  # the cheapest deployment as fast as the fastest (fewer GPUs, cheaper pools)
        best = best_cost()
        right = best / c_lb if c_lb > 0 else t_fast * SPAN
        right = min(right, t_fast * SPAN, limit if limit is not None else math.inf)
        if right > t_fast * (1 + rel):
            at(right)
            steps = min(GRID_POINTS, math.ceil(math.log(right / t_fast) / math.log(GRID_RATIO)))
            for k in range(1, steps):  # a coarse grid first: the frontier over the whole range
                at(t_fast * (right / t_fast) ** (k / steps))
    bound = 0.0
    while True:
        best = best_cost()
        gaps = _open_gaps(solved, best, rel)
        bound = min((gap[0] for gap in gaps), default=best)
        if not gaps or len(solved) >= max_solves:
            break
        _, lo, hi, price = gaps[0]
        # The T at which the gap's bound would reach the best: an answer as dear as the left end's closes the gap
        # whole (c* flat up to T, and past T the bound is met); a cheaper one splits it. Else its middle.
        reach = best * (1 - rel) / price
        at(reach if lo * (1 + 1e-6) < reach < hi * (1 - 1e-6) else math.sqrt(lo * hi))
    points = tuple(p for p in solved.values() if p is not None)
    closed = not _open_gaps(solved, best_cost(), rel)
    return CostSweep(
        points=points, solves=tuple(solves), fastest=fastest, closed=closed, bound=bound, notes=tuple(notes)
    )


def _open_gaps(
    solved: dict[float, SweepPoint | None], best: float, rel: float
) -> list[tuple[float, float, float, float]]:
    """(lower bound, lo, hi, c(p_hi)) of every gap between solved T where a cheaper step may lie, lowest bound
    first."""
    ts = sorted(t for t, p in solved.items() if p is not None)
    gaps = []
    for a, b in zip(ts, ts[1:]):
        pa, pb = solved[a], solved[b]
        assert pa is not None and pb is not None
        hi = pb.makespan  # c* = c(p_b) on [t(p_b), T_b]
        if hi <= a * (1 + 1e-9) or pa.price <= pb.price * (1 + 1e-12):
            continue  # nothing unknown, or c* flat on [T_a, T_b], where the step's cost only rises
        lower = a * pb.price
        if lower < best * (1 - rel):
            gaps.append((lower, a, hi, pb.price))
    return sorted(gaps)


def pareto(items: Sequence[T], makespan: Callable[[T], float], cost: Callable[[T], float]) -> list[T]:
    """The items no other beats on both (a faster or equal step at a lower or equal cost, one of them strictly):
    the cost frontier, fastest first. Of equal points the first is kept."""
    frontier: list[T] = []
    for x in sorted(items, key=lambda x: (makespan(x), cost(x))):
        if not math.isfinite(makespan(x)):
            continue
        if not frontier or cost(x) < cost(frontier[-1]):
            frontier.append(x)
    return frontier
