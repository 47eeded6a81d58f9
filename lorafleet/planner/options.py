"""Options of :func:`lorafleet.planner.plan_deployment`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.errors import InputError, coerce_enum_fields
from lorafleet.solvers import SolverName
from lorafleet.specs.cluster import price_too_large
from lorafleet.specs.dispatch import DispatchPolicy
from lorafleet.specs.objective import TIE_REL, PlanObjective

if TYPE_CHECKING:
    from lorafleet.plans import DeploymentPlan

OPTIONS_SOURCE = "<planner options>"


class PlannerMode(StrEnum):
    """How the candidate deployments are found."""

    DECOMPOSED = "decomposed"
    """The default: the k best deployments of the aggregated MILP, filtered by LobRA's
    Theorem 1 bound, judged by the dispatcher's load model."""
    EXHAUSTIVE = "exhaustive"
    """Every maximal deployment of every valid config (small instances; the reference)."""
    JOINT_MINLP = "joint-minlp"
    """LobRA's joint MINLP on SCIP over the proposed configs (small instances; a check)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerOptions:
    """Everything the planner may be told; defaults follow LobRA where it has one.

    The knobs are grouped by the stage of :func:`~lorafleet.planner.plan_deployment` they steer
    (flat, so ``PlannerOptions(robust_samples=0)`` reads as it does on the command line):

    1. **policy**: how the plan's steps are dispatched, one :class:`DispatchPolicy` (judged under and
       recorded in the plan whole: bucket count, padding or packing, pipeline window, ...);
    2. **solvers**: ``solver``, ``time_limit_s``, ``gap_rel``;
    3. **search** for the pool of deployments: ``mode``, then per mode ``pool_size``,
       ``search_rounds``, ``polish_starts``, ``polish_evaluations`` (decomposed) and
       ``enumeration_limit`` (exhaustive);
    4. **filter and judge**: ``lower_bound_threshold``, ``min_survivors``, ``exact_top``;
    5. **robust race** on sampled batches: ``robust_top``, ``robust_samples``, ``race_rung``, ``seed``;
    6. **objective**: ``objective``, ``tie_rel``, ``max_step_s``, ``max_step_cost``, ``prices``
       (:func:`~lorafleet.planner.objective.preferred`);
    7. **report**: ``baselines``.

    A re-plan of a saved plan takes its options from :meth:`replanning`: what the plan was planned for.
    """

    # 1. policy
    policy: DispatchPolicy = DispatchPolicy()
    """How the plan's steps are dispatched: every deployment is judged under it (its bucket count, micro-batch
    mode and pipeline window price the expected and sampled steps), the baselines share its bucket count and
    window, and the plan records it whole. A re-plan passes the running plan's policy (``train``)."""

    # 2. solvers
    solver: SolverName = SolverName.CBC
    """Back end of the aggregated MILP and of the exact dispatch ILP (CBC, SCIP or HiGHS)."""
    time_limit_s: float = 10.0
    """Time limit of every single solve, seconds: CPU seconds for CBC (``solvers``: a wall-clock limit made plans
    depend on the machine's load), wall-clock for SCIP and HiGHS; on failure the planner falls back with a warning."""
    gap_rel: float = 5e-3
    """Relative optimality gap of the exact dispatch ILP (LobRA's SCIP ``limits/gap``)."""

    # 3. search
    mode: PlannerMode = PlannerMode.DECOMPOSED
    """How deployments are searched (see PlannerMode)."""
    pool_size: int = 8
    """Decomposed mode: up to ``pool_size - 1`` branch optima around the center deployment per round."""
    search_rounds: int = 3
    """Decomposed mode: rounds of branching, each around the best plan so far (stops early when it stays)."""
    polish_starts: int = 4
    """Decomposed mode: the best plans a local search of GPU-neutral swaps starts from."""
    polish_evaluations: int = 64
    """... and the swapped deployments it looks at, at most, in all (0: no polish)."""
    enumeration_limit: int = 20_000
    """Exhaustive mode refuses instances with more deployments than this."""
    incumbent: tuple[tuple[ParallelConfig, int], ...] = ()
    """A running deployment's ``(config, replicas)``: entered into the pool as it stands (the warm start
    of an incremental re-plan, ``planner.incremental``), so the plan found is never judged worse than it."""

    # 4. filter and judge
    lower_bound_threshold: float = 0.15
    """Drop deployments whose Theorem-1 bound is more than this fraction above the best (LobRA: 15 %)."""
    min_survivors: int = 8
    """... but keep at least this many (LobRA: 8)."""
    exact_top: int = 0
    """Deployments (best expected makespan first) whose expected dispatch is re-solved by the exact
    dispatch ILP (bounded by the fast one). 0 by default: on our instances it improves the fast
    dispatch by under 0.5 % at 10-100x the time (CBC often needs seconds)."""

    # 5. robust race
    robust_top: int = 3
    """Deployments evaluated on sampled batches with the real per-step dispatch; the best mean wins.
    Three, not two: on 32 held-out batches the third plan won 3 of 9 test workloads (-0.4 % to
    -5.6 % GPU-s, never worse) for ~0.5-1.4 s more of the race (docs/planner.md)."""
    robust_samples: int = 32
    """K: sampled global batches of the robust evaluation (at most); 0 picks on the expected batch alone."""
    race_rung: int = 8
    """Robust stage: sampled batches per round of successive halving (``objective.race``); at
    ``robust_samples`` or more, every finalist is dispatched on all K batches."""
    seed: int | None = None
    """Seed of the sampled batches; None: the workload's seed."""

    # 6. objective
    objective: PlanObjective = PlanObjective.MAKESPAN
    """``makespan``: among plans of makespans within ``tie_rel`` of the fastest, the one on fewest GPUs. ``cost``:
    the fewest currency units per step at the pools' prices, over every deployment of any subset of the pools'
    GPUs, within ``max_step_s`` when given; with ``max_step_cost`` alone, the fastest step within that cost
    (``objective.preferred``, the search: ``planner.cost_search``)."""
    tie_rel: float = TIE_REL
    """Makespans within this fraction count as equal, and the plan with fewer GPUs wins: the makespan tolerance.
    Under the ``cost`` objective, costs a step within this fraction count as equal, and the faster plan wins."""
    max_step_s: float | None = None
    """Under the ``cost`` objective, the longest expected step a plan may have, seconds (``plan --step-limit``,
    or a ``--deadline``'s hours over its steps); None: no limit, the cheapest step however long."""
    max_step_cost: float | None = None
    """Under the ``cost`` objective, the most currency units an expected step may cost at the pools' prices (``plan
    --max-cost AMOUNT``: AMOUNT over the job's steps); None: no cap. Alone it makes the objective the fastest step
    within the cap; with ``max_step_s``, the cheapest step within both (``objective.preferred``)."""
    prices: tuple[tuple[str, float], ...] = ()
    """``(pool, price per GPU-hour)`` pairs the planner prices those pools by instead of the cluster's (a
    re-plan's: the prices its plan recorded, :meth:`replanning`); empty: the cluster's prices."""

    # 7. report
    baselines: bool = True
    """Also plan and evaluate the Task-Fused (padding, packing) and Task-Sequential baselines."""

    def __post_init__(self) -> None:
        coerce_enum_fields(
            self, OPTIONS_SOURCE, {"mode": PlannerMode, "solver": SolverName, "objective": PlanObjective}
        )
        positive = {
            "time_limit_s": self.time_limit_s,
            "pool_size": self.pool_size,
            "search_rounds": self.search_rounds,
            "polish_starts": self.polish_starts,
            "enumeration_limit": self.enumeration_limit,
            "min_survivors": self.min_survivors,
            "robust_top": self.robust_top,
            "race_rung": self.race_rung,
        }
        for name, value in positive.items():
            if not value > 0:
                raise InputError(OPTIONS_SOURCE, name, f"must be > 0, got {value}")
        for name, value in {
            "gap_rel": self.gap_rel,
            "lower_bound_threshold": self.lower_bound_threshold,
            "tie_rel": self.tie_rel,
        }.items():
            if not 0 <= value < 1:
                raise InputError(OPTIONS_SOURCE, name, f"must be in [0, 1), got {value}")
        for pool, price in self.prices:
            if not price >= 0:
                raise InputError(OPTIONS_SOURCE, "prices", f"pool {pool!r}: a price must be >= 0, got {price}")
            if price_too_large(price):
                raise InputError(OPTIONS_SOURCE, "prices", f"pool {pool!r}: a price {price_too_large(price)}")
        if self.max_step_s is not None and not (0 < self.max_step_s < float("inf")):
            raise InputError(OPTIONS_SOURCE, "max_step_s", f"must be > 0 seconds and finite, got {self.max_step_s}")
        if self.max_step_s is not None and self.objective is not PlanObjective.COST:
            raise InputError(OPTIONS_SOURCE, "max_step_s", "a step-time limit goes with the cost objective")
        if self.max_step_cost is not None and not (0 < self.max_step_cost < float("inf")):
            raise InputError(OPTIONS_SOURCE, "max_step_cost", f"must be > 0 and finite, got {self.max_step_cost}")
        if self.max_step_cost is not None and self.objective is not PlanObjective.COST:
            raise InputError(OPTIONS_SOURCE, "max_step_cost", "a step-cost cap goes with the cost objective")
        for name, value in {
            "polish_evaluations": self.polish_evaluations,
            "exact_top": self.exact_top,
            "robust_samples": self.robust_samples,
        }.items():
            if value < 0:
                raise InputError(OPTIONS_SOURCE, name, f"must be >= 0, got {value}")

    def replanning(self, plan: DeploymentPlan, policy: DispatchPolicy | None = None) -> PlannerOptions:
        """These options for a re-plan of ``plan``: by what it was planned for, its ``objective``, ``tie_rel``,
        step-time limit (``max_step_s``), step-cost cap (``max_step_cost``) and pools' prices
        (``DeploymentPlan.prices``), judged under ``policy`` (default: the plan's own), without baselines. Every
        re-plan of a running plan takes its options here (``train.replan.replan_run``,
        ``planner.incremental.replan_incremental``), so a fleet planned by cost on priced pools is re-planned by cost
        at those prices, within its limit and cap; a plan of schema 3 or older records the defaults (makespan,
        ``TIE_REL``, no prices)."""
        return replace(
            self,
            policy=plan.policy if policy is None else policy,
            objective=plan.objective,
            tie_rel=plan.tie_rel,
            max_step_s=plan.max_step_s,
            max_step_cost=plan.max_step_cost,
            prices=plan.prices,
            baselines=False,
        )
