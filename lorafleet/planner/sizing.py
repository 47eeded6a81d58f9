"""Sizing the fleet: how many GPUs (whole nodes) to plan a workload on, for a goal.

``size_fleet`` plans the workload with :func:`~lorafleet.planner.plan_deployment` on every
candidate count n = k x ``gpus_per_node`` GPUs, k = 1 .. K nodes (K the cluster's nodes, or
``max_nodes``), and judges the plans, as DLRover's resource-performance model sizes a job: each
count's figures come from its own plan, not from an extrapolation. With t̂(n) the expected step
makespan of n's plan (the dispatcher's estimate on the expected batch), G(n) the GPUs that plan
uses (a plan may leave some idle) and S the job's steps,

    job hours       H(n) = t̂(n) S / 3600
    job GPU-hours   C(n) = t̂(n) G(n) S / 3600

and the chosen count n* is, over the counts that give a plan:

- no deadline, no budget (``SizingGoal.GPU_SECONDS``): n* = argmin_lex (C(n), n), the fewest
  GPU-seconds for the job, ties to fewer GPUs (S is a constant factor: without S, t̂ G per step
  decides the same way);
- a deadline of S_d steps in H_d hours (``DEADLINE``): n* = min { n : t̂(n) S_d <= 3600 H_d },
  the fewest GPUs that finish in time (S = S_d);
- a budget of B GPU-hours (``BUDGET``): n* = argmin_lex { (t̂(n), n) : C(n) <= B }, the
  fastest plan the budget pays for;
- both (``DEADLINE_AND_BUDGET``): n* = argmin_lex { (C(n), n) : H(n) <= H_d, C(n) <= B }, the
  cheapest plan that meets both.

**Pools.** On a cluster of several pools the candidates are every combination of each pool's
node count, 0 .. its ``nodes`` (or ``max_nodes``), some pool not empty: "how many H100 nodes to
add to these A100s" is the rows with the A100 pool whole. With a price on every pool (one pool or
several) the sizing counts money where it counted GPUs: with P(n) what candidate n's plan costs a
second at its pools' prices (``accounting.price_per_second``), a job costs t̂(n) P(n) S, and the
GPU-seconds goal becomes the cheapest job, argmin_lex (t̂(n) P(n), n), the deadline goal the cheapest
job that finishes in time, argmin_lex { (t̂(n) P(n), n) : t̂(n) S_d <= 3600 H_d } (a budget stays
in GPU-hours).

When no count qualifies, :class:`SizingError` (an InputError) says which limit was missed and
by how much, and carries the sweep. ``size_fleet`` is :func:`plan_counts` (the planning, one row
per count) then :func:`judge` (the choice, pure: the same rows can be judged for other goals).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from lorafleet.accounting import price_per_second
from lorafleet.costmodel.cost_model import CostModel
from lorafleet.errors import InputError
from lorafleet.planner.driver import LORAFLEET, PlanResult, plan_deployment
from lorafleet.planner.options import PlannerOptions
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Workload

OBJECTIVE_SOURCE = "<sizing objective>"
"""The source an InputError about the objective names; its fields are ``deadline``,
``budget_gpu_hours``, ``steps`` and ``max_nodes`` (a command maps them to its flags)."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """``steps`` training steps within ``hours`` hours of wall clock."""

    steps: int
    hours: float

    def __post_init__(self) -> None:
        if not self.steps >= 1:
            raise InputError(OBJECTIVE_SOURCE, "deadline", f"steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.hours) and self.hours > 0):
            raise InputError(OBJECTIVE_SOURCE, "deadline", f"hours must be > 0, got {self.hours}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SizingObjective:
    """The goal of a sizing: a deadline, a GPU-hour budget, both, or neither (fewest GPU-seconds)."""

    deadline: Deadline | None = None
    budget_gpu_hours: float | None = None
    steps: int | None = None
    """The job's steps where no deadline gives them; None: the workload's (:func:`job_steps`)."""

    def __post_init__(self) -> None:
        budget = self.budget_gpu_hours
        if budget is not None and not (math.isfinite(budget) and budget > 0):
            raise InputError(OBJECTIVE_SOURCE, "budget_gpu_hours", f"must be > 0 GPU-hours, got {budget}")
        if self.steps is not None and self.steps < 1:
            raise InputError(OBJECTIVE_SOURCE, "steps", f"must be >= 1, got {self.steps}")
        if self.steps is not None and self.deadline is not None:
            given = self.deadline.steps
            raise InputError(OBJECTIVE_SOURCE, "steps", f"the deadline gives the steps ({given}); give one of them")

    @property
    def goal(self) -> SizingGoal:
        if self.deadline is not None and self.budget_gpu_hours is not None:
            return SizingGoal.DEADLINE_AND_BUDGET
        if self.deadline is not None:
            return SizingGoal.DEADLINE
        if self.budget_gpu_hours is not None:
            return SizingGoal.BUDGET
        return SizingGoal.GPU_SECONDS


class SizingGoal(StrEnum):
    """What the chosen count is best at (see the module docstring for the math)."""

    GPU_SECONDS = "gpu-seconds"
    DEADLINE = "deadline"
    BUDGET = "budget"
    DEADLINE_AND_BUDGET = "deadline+budget"


def describe_objective(objective: SizingObjective, priced: bool = False) -> str:
    """``fewest GPUs for 2000 steps in 1.5 h``: the goal in words (``priced``: the pools have prices)."""
    deadline, budget = objective.deadline, objective.budget_gpu_hours
    least = "cheapest" if priced else "fewest GPUs"
    return {
        SizingGoal.GPU_SECONDS: lambda: "cheapest at the pools' prices" if priced else "fewest GPU-seconds",
        SizingGoal.DEADLINE: lambda: f"{least} for {deadline.steps} steps in {_hours(deadline.hours)}",
        SizingGoal.BUDGET: lambda: f"fastest within {budget:.4g} GPU-hours",
        SizingGoal.DEADLINE_AND_BUDGET: lambda: (
            f"fewest GPU-hours for {deadline.steps} steps in {_hours(deadline.hours)} within {budget:.4g} GPU-hours"
        ),
    }[objective.goal]()


def job_steps(workload: Workload, objective: SizingObjective) -> int | None:
    """The job's steps: the deadline's, else ``objective.steps``, else the last step a task of the
    workload is given (its ``start_step + steps``, largest over the tasks that set ``steps``), else None."""
    if objective.deadline is not None:
        return objective.deadline.steps
    if objective.steps is not None:
        return objective.steps
    ends = [t.spec.start_step + t.spec.steps for t in workload.tasks if t.spec.steps is not None]
    return max(ends, default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class SizingRow:
    """One candidate GPU count and its plan (None when the planner found none)."""

    cluster: ClusterSpec
    result: PlanResult | None
    error: InputError | None = None
    """Why there is no plan (the planner's error); None when there is one."""
    job_steps: int | None = None
    """S, set by :func:`judge`; None: the job totals are unknown."""
    plan_s: float = 0.0
    """Seconds the planner took on this count."""

    @property
    def gpus(self) -> int:
        """n: the GPUs of the candidate cluster (``cluster.nodes`` whole nodes)."""
        return self.cluster.n_gpus

    @property
    def infeasible(self) -> str | None:
        """The planner's message when there is no plan."""
        return None if self.error is None else self.error.msg

    @property
    def feasible(self) -> bool:
        return self.result is not None

    @property
    def step_s(self) -> float:
        """t̂(n): the plan's expected step makespan (inf when infeasible)."""
        return self.result.cost(LORAFLEET).makespan_s if self.result is not None else math.inf

    @property
    def used_gpus(self) -> int:
        """G(n): the GPUs the plan uses."""
        return self.result.plan.used_gpus if self.result is not None else 0

    @property
    def gpu_seconds_per_step(self) -> float:
        """t̂(n) G(n)."""
        return self.result.cost(LORAFLEET).gpu_seconds if self.result is not None else math.inf

    @property
    def cost_per_step(self) -> float | None:
        """t̂(n) P(n): what a step costs at the pools' prices; None when a pool has no price (inf: no plan)."""
        if self.result is None:
            return math.inf
        price = price_per_second(self.result.plan, self.cluster)
        return None if price is None else self.step_s * price

    @property
    def nodes(self) -> str:
        """``2``, or by named pool ``a100 2, h100 1``."""
        return ", ".join(f"{p.name} {p.nodes}" if p.name else str(p.nodes) for p in self.cluster.pools)

    @property
    def job_hours(self) -> float | None:
        """H(n), or None when the job's steps are unknown."""
        return None if self.job_steps is None else self.step_s * self.job_steps / 3600

    @property
    def job_gpu_hours(self) -> float | None:
        """C(n), or None when the job's steps are unknown."""
        return None if self.job_steps is None else self.gpu_seconds_per_step * self.job_steps / 3600

    def meets(self, objective: SizingObjective) -> bool:
        """Whether the plan exists and keeps the objective's deadline and budget (those it has)."""
        if not self.feasible:
            return False
        if objective.deadline is not None and not self.job_hours <= objective.deadline.hours:
            return False
        return objective.budget_gpu_hours is None or self.job_gpu_hours <= objective.budget_gpu_hours


@dataclass(frozen=True, kw_only=True, slots=True)
class SizingResult:
    """Every candidate count's row, smallest first, and the chosen one."""

    rows: tuple[SizingRow, ...]
    objective: SizingObjective
    job_steps: int | None
    chosen: int | None
    """Index into ``rows``; None only on the sweep a :class:`SizingError` carries."""
    reason: str
    """Why that row (or, on an error's sweep, why none)."""

    @property
    def chosen_row(self) -> SizingRow:
        if self.chosen is None:
            raise ValueError(f"no count was chosen: {self.reason}")
        return self.rows[self.chosen]


class SizingError(InputError):
    """No candidate count gives a plan, or none meets the objective; ``sweep`` holds every row."""

    def __init__(self, path: str, field: str, msg: str, sweep: SizingResult) -> None:
        super().__init__(path, field, msg)
        self.sweep = sweep


def _hours(h: float) -> str:
    return f"{h:.3g} h"


def _span(rows: Sequence[SizingRow]) -> str:
    """``8 to 32 GPUs``, or ``8 GPUs`` for one count."""
    return f"{rows[0].gpus} to {rows[-1].gpus} GPUs" if len(rows) > 1 else f"{rows[0].gpus} GPUs"


def _choose(rows: list[SizingRow], objective: SizingObjective, steps: int | None) -> tuple[int | None, str, str]:
    """(index of the chosen row or None, the reason, the objective field a miss names)."""
    feasible = [k for k, r in enumerate(rows) if r.feasible]
    meeting = [k for k in feasible if rows[k].meets(objective)]
    goal, deadline, budget = objective.goal, objective.deadline, objective.budget_gpu_hours
    of = f"of {len(feasible)} feasible count{'s' if len(feasible) != 1 else ''}"
    priced = all(rows[k].cost_per_step is not None for k in feasible)
    if goal is SizingGoal.GPU_SECONDS and priced:
        k = min(feasible, key=lambda k: (rows[k].cost_per_step, rows[k].gpus))
        job = f", {rows[k].cost_per_step * steps:.4g} for {steps} steps" if steps else ""
        return k, f"cheapest {of} at the pools' prices ({rows[k].cost_per_step:.4g} a step{job})", ""
    if goal is SizingGoal.GPU_SECONDS:
        k = min(feasible, key=lambda k: (rows[k].gpu_seconds_per_step, rows[k].gpus))
        job = f", {rows[k].job_gpu_hours:.4g} GPU-hours for {steps} steps" if steps else ""
        return k, f"fewest GPU-seconds {of} ({rows[k].gpu_seconds_per_step:.4g} GPU-s per step{job})", ""
    if meeting:
        if goal is SizingGoal.DEADLINE and priced:
            k = min(meeting, key=lambda k: (rows[k].cost_per_step, rows[k].gpus))
            why = (
                f"cheapest that finishes {steps} steps within {_hours(deadline.hours)} at the pools' prices "
                f"({_hours(rows[k].job_hours)}, {rows[k].cost_per_step * steps:.4g})"
            )
        elif goal is SizingGoal.DEADLINE:
            k = min(meeting, key=lambda k: rows[k].gpus)
            why = f"fewest GPUs that finish {steps} steps within {_hours(deadline.hours)} ({_hours(rows[k].job_hours)})"
        elif goal is SizingGoal.BUDGET:
            k = min(meeting, key=lambda k: (rows[k].step_s, rows[k].gpus))
            why = f"fastest plan within {budget:.4g} GPU-hours ({rows[k].job_gpu_hours:.4g} GPU-hours)"
        else:
            k = min(meeting, key=lambda k: (rows[k].job_gpu_hours, rows[k].gpus))
            why = (
                f"fewest GPU-hours that finish {steps} steps within {_hours(deadline.hours)} and "
                f"{budget:.4g} GPU-hours ({_hours(rows[k].job_hours)}, {rows[k].job_gpu_hours:.4g} GPU-hours)"
            )
        return k, why, ""
    none = f"none of the counts swept ({_span(rows)})"
    fastest = min(feasible, key=lambda k: (rows[k].step_s, rows[k].gpus))
    cheapest = min(feasible, key=lambda k: (rows[k].gpu_seconds_per_step, rows[k].gpus))
    if deadline is not None and not any(rows[k].job_hours <= deadline.hours for k in feasible):
        return (
            None,
            f"{none} finishes {steps} steps within {_hours(deadline.hours)}: the fastest found, "
            f"{rows[fastest].gpus} GPUs, takes {_hours(rows[fastest].job_hours)}",
            "deadline",
        )
    if budget is not None and not any(rows[k].job_gpu_hours <= budget for k in feasible):
        return (
            None,
            f"{none} runs {steps} steps within {budget:.4g} GPU-hours: the cheapest found, "
            f"{rows[cheapest].gpus} GPUs, needs {rows[cheapest].job_gpu_hours:.4g} GPU-hours",
            "budget_gpu_hours",
        )
    on_time = [k for k in feasible if rows[k].job_hours <= deadline.hours]
    least = min(on_time, key=lambda k: (rows[k].job_gpu_hours, rows[k].gpus))
    return (
        None,
        f"{none} meets both the deadline and the budget: the cheapest that finishes "
        f"{steps} steps within {_hours(deadline.hours)}, {rows[least].gpus} GPUs, needs "
        f"{rows[least].job_gpu_hours:.4g} GPU-hours, more than {budget:.4g}",
        "budget_gpu_hours",
    )


def plan_counts(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: CostModel | Callable[[ClusterSpec], CostModel],
    options: PlannerOptions = PlannerOptions(),
    *,
    max_nodes: int | None = None,
) -> tuple[SizingRow, ...]:
    """The workload planned on every candidate cluster (:func:`candidate_clusters`), one row each, smallest
    first. A row's plan is the one planning that cluster alone gives; one with no plan (the model or a
    task's longest sequence fits no config: the planner's InputError) is a row with its ``error``.
    Arguments as :func:`size_fleet`'s.
    """
    rows = []
    for candidate in candidate_clusters(cluster, max_nodes):
        model = cost_model(candidate) if callable(cost_model) else cost_model
        start = time.perf_counter()
        try:
            result, error = plan_deployment(workload, candidate, model, options), None
        except InputError as err:
            result, error = None, err
        rows.append(SizingRow(cluster=candidate, result=result, error=error, plan_s=time.perf_counter() - start))
    return tuple(rows)


def candidate_clusters(cluster: ClusterSpec, max_nodes: int | None = None) -> list[ClusterSpec]:
    """The clusters a sizing plans: of one pool, 1 .. K whole nodes (K its ``nodes``, or ``max_nodes``),
    each ``ClusterSpec.with_gpus(n, gpu, gpus_per_node)`` as ``plan --gpus n`` builds it (the pool's name,
    price and profile kept); of several, every combination of each pool's 0 .. K_p nodes (K_p its
    ``nodes``, or ``max_nodes``) with some pool not empty, the empty pools left out. Fewest GPUs first,
    then more nodes of the earlier pools."""
    if max_nodes is not None and max_nodes < 1:
        raise InputError(OBJECTIVE_SOURCE, "max_nodes", f"must be >= 1, got {max_nodes}")
    if len(cluster.pools) == 1:
        pool = cluster.pools[0]
        kept = {"name": pool.name, "price_per_gpu_hour": pool.price_per_gpu_hour, "profile": pool.profile}
        nodes = pool.nodes if max_nodes is None else max_nodes
        return [
            ClusterSpec.with_gpus(k * pool.gpus_per_node, pool.gpu, pool.gpus_per_node, **kept)
            for k in range(1, nodes + 1)
        ]
    ranges = [range(0, (p.nodes if max_nodes is None else max_nodes) + 1) for p in cluster.pools]
    out = []
    for counts in itertools.product(*ranges):
        pools = tuple(p.model_copy(update={"nodes": n}) for p, n in zip(cluster.pools, counts, strict=True) if n)
        if pools:
            out.append((sum(n * p.gpus_per_node for p, n in zip(cluster.pools, counts)), [-n for n in counts], pools))
    return [ClusterSpec(pools=pools) for *_, pools in sorted(out, key=lambda x: x[:2])]


def _check_steps(objective: SizingObjective, steps: int | None) -> None:
    if objective.budget_gpu_hours is not None and steps is None:
        raise InputError(
            OBJECTIVE_SOURCE,
            "steps",
            "a GPU-hour budget needs the job's steps: none given, and no task of the workload sets steps",
        )


def judge(rows: Sequence[SizingRow], objective: SizingObjective, steps: int | None) -> SizingResult:
    """The rows with the job's ``steps`` S, and the one ``objective`` chooses (the module docstring).

    Raises:
        InputError: a budget with no ``steps`` (``OBJECTIVE_SOURCE``, ``steps``).
        SizingError: no row has a plan (the planner's error of the largest count, its source and field),
            or none meets the objective (``deadline`` or ``budget_gpu_hours``).
    """
    _check_steps(objective, steps)
    rows = [replace(r, job_steps=steps) for r in rows]
    if not any(r.feasible for r in rows):
        last = rows[-1].error
        sweep = SizingResult(rows=tuple(rows), objective=objective, job_steps=steps, chosen=None, reason=last.msg)
        raise SizingError(last.path, last.field, f"no plan on any count swept ({_span(rows)}): {last.msg}", sweep)
    chosen, reason, missed = _choose(rows, objective, steps)
    sweep = SizingResult(rows=tuple(rows), objective=objective, job_steps=steps, chosen=chosen, reason=reason)
    if chosen is None:
        raise SizingError(OBJECTIVE_SOURCE, missed, reason, sweep)
    return sweep


def size_fleet(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: CostModel | Callable[[ClusterSpec], CostModel],
    options: PlannerOptions = PlannerOptions(),
    objective: SizingObjective = SizingObjective(),
    *,
    max_nodes: int | None = None,
) -> SizingResult:
    """Plan ``workload`` on 1 .. K whole nodes of ``cluster``'s kind (:func:`plan_counts`) and choose the
    count the objective prefers (:func:`judge`; the math: the module docstring).

    Args:
        cluster: the GPU kind and GPUs per node; its ``nodes`` is K unless ``max_nodes`` is given.
        cost_model: the cost model of every count, or a function of the candidate cluster that builds
            it (the analytic model prices the gradient all-reduce by whether the cluster spans nodes).
        options: the planner's options, the same for every count.
        objective: the goal; the job's steps are :func:`job_steps`'s.
        max_nodes: K, the most nodes swept.

    Raises:
        InputError: ``max_nodes`` < 1 or a budget with no job steps (``OBJECTIVE_SOURCE``), before any
            planning; :class:`SizingError` as :func:`judge` raises it.
    """
    steps = job_steps(workload, objective)
    _check_steps(objective, steps)
    return judge(plan_counts(workload, cluster, cost_model, options, max_nodes=max_nodes), objective, steps)
