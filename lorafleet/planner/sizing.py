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
node count, 0 .. its ``nodes`` (or ``max_nodes``), some pool not empty (:func:`candidate_clusters`,
all planned: the bounds below are of one kind): "how many H100 nodes to add to these A100s" is the
rows with the A100 pool whole. With a price on every pool such a sweep counts money where it counts
GPUs: with P(n) what candidate n's plan costs a second at its pools' prices
(``accounting.price_per_second``), the GPU-seconds goal becomes the cheapest step, argmin_lex
(t̂(n) P(n), n), and the deadline goal the cheapest step that finishes in time, argmin_lex
{ (t̂(n) P(n), n) : t̂(n) S_d <= 3600 H_d } (a budget stays in GPU-hours). On one pool money is
proportional to GPU-seconds, and the goals stand as above.

When no count qualifies, :class:`SizingError` (an InputError) says which limit was missed and
by how much, and carries the sweep. ``size_fleet`` is :func:`sweep_counts` (the planning, one row
per count planned) then :func:`judge` (the choice, pure: the same rows can be judged for other goals).

**Which counts are planned.** K is at most :data:`~lorafleet.specs.cluster.MAX_NODES` (4,096 nodes,
``ClusterSpec.nodes``' limit), and the sweep plans only the counts its goal needs (``docs/planner.md``
says why each rule is exact or not). Two lower bounds hold for any plan, found without planning
(:class:`CountBounds`, on the expected batch, from the configs of K nodes): a plan on G GPUs has
t̂ >= W / G (W the batch's least GPU-seconds, the fleet bound of ``planner.bounds``) and t̂ >= t_0 (the
least stage time of the batch's hardest sequence on its best config), so C = t̂ G >= t_0 G. Then:

- ``DEADLINE``: a galloping search, k = 1, 2, 4, ... until a count meets the deadline, then bisection
  between the last that missed and it: O(log k*) plans for the smallest count k* that meets it, exact
  when t̂ does not rise with k (true of optimal plans: a k-node plan is a (k+1)-node plan with a node
  idle). A deadline below t_0 S, or below max(W / (8K), t_0) S, is missed by every count: the search
  stops without planning more;
- ``GPU_SECONDS``: counts in order until t_0 · n >= C*, the least per-step GPU-seconds so far: a plan on
  more GPUs costs more, and one on fewer is a plan of a count already planned (exact as far as the
  planner is optimal for each count);
- ``BUDGET``: counts in order until t_0 · n · S / 3600 >= B: no plan on more GPUs is within the budget;
- ``DEADLINE_AND_BUDGET``: the deadline's search for k*, then counts from k* on until t_0 · n reaches the
  cheaper of C* and the budget's per-step GPU-seconds.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from lorafleet.accounting import price_per_second
from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import sequence_lower_bound
from lorafleet.errors import InputError
from lorafleet.planner.bounds import fleet_bound
from lorafleet.planner.candidates import valid_candidates
from lorafleet.planner.driver import LORAFLEET, PlanResult, plan_deployment
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.options import PlannerOptions
from lorafleet.specs.cluster import MAX_NODES, ClusterSpec
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
    """``fewest GPUs for 2000 steps in 1.5 h``: the goal in words (``priced``: a sweep over pools with prices)."""
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
    """The row of every count planned (all up to K, or those the goal's search needed), smallest first, and
    the chosen one."""

    rows: tuple[SizingRow, ...]
    objective: SizingObjective
    job_steps: int | None
    chosen: int | None
    """Index into ``rows``; None only on the sweep a :class:`SizingError` carries."""
    reason: str
    """Why that row (or, on an error's sweep, why none)."""
    stopped: str = ""
    """Why the sweep planned no more counts (empty: it planned every count up to K)."""

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
    if by_cost(rows):
        if goal is SizingGoal.GPU_SECONDS:
            k = min(feasible, key=lambda k: (rows[k].cost_per_step, rows[k].gpus))
            job = f", {rows[k].cost_per_step * steps:.4g} for {steps} steps" if steps else ""
            return k, f"cheapest {of} at the pools' prices ({rows[k].cost_per_step:.4g} a step{job})", ""
        if goal is SizingGoal.DEADLINE and meeting:
            k = min(meeting, key=lambda k: (rows[k].cost_per_step, rows[k].gpus))
            why = (
                f"cheapest that finishes {steps} steps within {_hours(deadline.hours)} at the pools' prices "
                f"({_hours(rows[k].job_hours)}, {rows[k].cost_per_step * steps:.4g})"
            )
            return k, why, ""
    if goal is SizingGoal.GPU_SECONDS:
        k = min(feasible, key=lambda k: (rows[k].gpu_seconds_per_step, rows[k].gpus))
        job = f", {rows[k].job_gpu_hours:.4g} GPU-hours for {steps} steps" if steps else ""
        return k, f"fewest GPU-seconds {of} ({rows[k].gpu_seconds_per_step:.4g} GPU-s per step{job})", ""
    if meeting:
        if goal is SizingGoal.DEADLINE:
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
    """The workload planned on every candidate cluster (:func:`candidate_clusters`: 1 .. K whole nodes of one
    pool, each ``ClusterSpec.with_gpus(n, gpu, gpus_per_node)`` as ``plan --gpus n`` builds its own; every
    combination of several pools' nodes), one row each, smallest first. A candidate with no plan (the model
    or a task's longest sequence fits no config: the planner's InputError) is a row with its ``error``.
    Arguments as :func:`size_fleet`'s.
    """
    return tuple(_plan_cluster(workload, cost_model, options, c) for c in candidate_clusters(cluster, max_nodes))


def _max_nodes(cluster: ClusterSpec, max_nodes: int | None) -> int:
    """K: ``max_nodes``, else the cluster's nodes; an InputError unless 1 <= K <= MAX_NODES."""
    nodes = cluster.nodes if max_nodes is None else max_nodes
    if nodes < 1:
        raise InputError(OBJECTIVE_SOURCE, "max_nodes", f"must be >= 1, got {nodes}")
    if nodes > MAX_NODES:
        raise InputError(
            OBJECTIVE_SOURCE,
            "max_nodes",
            f"must be at most {MAX_NODES} (the most nodes a cluster has: specs.cluster.MAX_NODES), got {nodes}",
        )
    return nodes


def _candidate(cluster: ClusterSpec, k: int) -> ClusterSpec:
    """``k`` whole nodes of a one-pool ``cluster``, as ``plan --gpus n`` builds them (the pool's name, price and
    profile kept)."""
    pool = cluster.pools[0]
    kept = {"name": pool.name, "price_per_gpu_hour": pool.price_per_gpu_hour, "profile": pool.profile}
    return ClusterSpec.with_gpus(k * pool.gpus_per_node, pool.gpu, pool.gpus_per_node, **kept)


def plan_count(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: CostModel | Callable[[ClusterSpec], CostModel],
    options: PlannerOptions,
    k: int,
) -> SizingRow:
    """The row of ``k`` whole nodes of ``cluster``'s kind: its plan, or the planner's InputError."""
    return _plan_cluster(workload, cost_model, options, _candidate(cluster, k))


@dataclass(frozen=True, slots=True)
class CountBounds:
    """Lower bounds of every count's plan, found without planning (the module docstring): on the expected
    batch, over the configs of the largest cluster swept (:meth:`swept`)."""

    work_gpu_s: float
    """W = sum_q min_c g_c r_c(l_q): no plan's step costs fewer GPU-seconds (``planner.bounds.fleet_bound``)."""
    floor_s: float
    """t_0 = max_q min_c r_c(l_q) (1 + (pp_c - 1) / W): no plan's step is shorter (the hardest sequence on its best
    config, with the least pipeline bubble a replica streaming windows of W steps pays: ``CostModel.replica_time``
    charges at least (pp - 1) / W of its largest stage time)."""

    def step_s(self, gpus: int) -> float:
        """The least t̂ of a plan on at most ``gpus`` GPUs: max(W / gpus, t_0)."""
        return max(self.work_gpu_s / gpus, self.floor_s)

    @classmethod
    def of(cls, workload: Workload, cluster: ClusterSpec, cost_model: CostModel, window: int) -> CountBounds:
        """The bounds of ``workload``'s expected batch on the configs of ``cluster``, priced by ``cost_model`` in
        pipeline windows of ``window`` steps."""
        batch = expected_global_batch(workload)
        candidates = valid_candidates(cost_model, cluster)
        if len(batch) == 0 or not candidates:
            return cls(0.0, 0.0)
        least = np.stack(
            [
                (1 + (c.config.pp - 1) / window)
                * sequence_lower_bound(cost_model, c.config, c.max_tokens, batch.lengths)
                for c in candidates
            ]
        ).min(axis=0)
        floor = float(least.max())
        return cls(fleet_bound(batch, candidates, cost_model, 1), floor if math.isfinite(floor) else 0.0)

    @classmethod
    def swept(
        cls,
        workload: Workload,
        cluster: ClusterSpec,
        cost_model: CostModel | Callable[[ClusterSpec], CostModel],
        nodes: int,
        window: int,
    ) -> CountBounds:
        """The bounds of every count of 1 .. ``nodes`` nodes: the least of those of one node's cost model and of
        ``nodes``' (a cost model prices a stage's transfers, and offers configs, by the cluster it is built for:
        within a node or across nodes), both over the configs of ``nodes`` nodes."""
        largest = _candidate(cluster, nodes)
        models = [cost_model(_candidate(cluster, 1)), cost_model(largest)] if callable(cost_model) else [cost_model]
        each = [cls.of(workload, largest, model, window) for model in models]
        return cls(min(b.work_gpu_s for b in each), min(b.floor_s for b in each))


Progress = Callable[[SizingRow, int], None]
"""Told each row as it is planned, with the number of counts planned so far."""


class _Sweep:
    """The counts planned so far, each once (the search may ask for one again)."""

    def __init__(self, plan: Callable[[int], SizingRow], progress: Progress | None) -> None:
        self._plan = plan
        self._progress = progress
        self.rows: dict[int, SizingRow] = {}

    def __call__(self, k: int) -> SizingRow:
        if k not in self.rows:
            self.rows[k] = self._plan(k)
            if self._progress is not None:
                self._progress(self.rows[k], len(self.rows))
        return self.rows[k]

    def ordered(self) -> tuple[SizingRow, ...]:
        return tuple(self.rows[k] for k in sorted(self.rows))


def _first_meeting(
    plan: _Sweep, nodes: int, meets: Callable[[SizingRow], bool], lowest: Callable[[int], float], target_s: float
) -> tuple[int | None, str]:
    """The smallest k in 1..nodes whose row ``meets`` (a galloping search, then bisection: the module
    docstring), or None; and why the search stopped. ``lowest(k)``: the least step time of k nodes' plans
    (a bound), which a count must get to ``target_s`` to meet."""
    if lowest(nodes) > target_s:
        return None, f"even {nodes} nodes take at least {lowest(nodes):.4g} s a step"
    missed, k = 0, 1
    while True:
        if lowest(k) <= target_s and meets(plan(k)):
            break
        missed = k
        if k == nodes:
            return None, ""
        k = min(2 * k, nodes)
    while k - missed > 1:  # meets(k), not meets(missed): bisect between them
        middle = (missed + k) // 2
        if lowest(middle) <= target_s and meets(plan(middle)):
            k = middle
        else:
            missed = middle
    return k, (
        f"{k} node{'s are' if k > 1 else ' is'} the fewest that meet{'' if k > 1 else 's'} it: galloping and "
        f"bisection planned {len(plan.rows)} of the {nodes} counts"
    )


def _scan(plan: _Sweep, start: int, nodes: int, enough: Callable[[int], bool], why: str, per_node: int) -> str:
    """Plan the counts start, start + 1, ... up to ``nodes`` until ``enough(k)`` after planning k; why it stopped
    (``why`` with ``{gpus}``, k's GPUs; empty when it reached ``nodes``)."""
    for k in range(start, nodes + 1):
        plan(k)
        if k < nodes and enough(k):
            return f"stopped after {k * per_node} GPUs: {why.format(gpus=k * per_node)}"
    return ""


def by_cost(rows: Sequence[SizingRow]) -> bool:
    """Whether a sweep counts money: its candidates span several pools and every pool has a price."""
    pools = {p.name for r in rows for p in r.cluster.pools}
    return len(pools) > 1 and all(r.cost_per_step is not None for r in rows)


def candidate_clusters(cluster: ClusterSpec, max_nodes: int | None = None) -> list[ClusterSpec]:
    """The clusters a sweep over pools plans: every combination of each pool's 0 .. K_p nodes (K_p its
    ``nodes``, or ``max_nodes``) with some pool not empty, the empty pools left out; fewest GPUs first, then
    more nodes of the earlier pools. (One pool: its whole-node counts 1 .. K, :func:`_candidate`.)"""
    if len(cluster.pools) == 1:
        return [_candidate(cluster, k) for k in range(1, _max_nodes(cluster, max_nodes) + 1)]
    ranges = [range(0, _max_nodes(cluster.only(p.name), max_nodes) + 1) for p in cluster.pools]
    out = []
    for counts in itertools.product(*ranges):
        pools = tuple(p.model_copy(update={"nodes": n}) for p, n in zip(cluster.pools, counts, strict=True) if n)
        if pools:
            out.append((sum(n * p.gpus_per_node for p, n in zip(cluster.pools, counts)), [-n for n in counts], pools))
    return [ClusterSpec(pools=pools) for *_, pools in sorted(out, key=lambda x: x[:2])]


def _plan_cluster(
    workload: Workload,
    cost_model: CostModel | Callable[[ClusterSpec], CostModel],
    options: PlannerOptions,
    candidate: ClusterSpec,
) -> SizingRow:
    """The row of one candidate cluster: its plan, or the planner's InputError."""
    model = cost_model(candidate) if callable(cost_model) else cost_model
    start = time.perf_counter()
    try:
        result, error = plan_deployment(workload, candidate, model, options), None
    except InputError as err:
        result, error = None, err
    return SizingRow(cluster=candidate, result=result, error=error, plan_s=time.perf_counter() - start)


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


def sweep_counts(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: CostModel | Callable[[ClusterSpec], CostModel],
    options: PlannerOptions,
    objective: SizingObjective,
    steps: int | None,
    *,
    max_nodes: int | None = None,
    progress: Progress | None = None,
) -> tuple[tuple[SizingRow, ...], str]:
    """The rows of the counts ``objective``'s goal needs planned, smallest first (the module docstring), and why
    the sweep stopped before K (empty when it planned every count up to K). Arguments as :func:`size_fleet`'s;
    ``progress`` is told each row as it is planned.

    Raises:
        SizingError: the bounds show that no count can meet the deadline or the budget (a sweep of no rows).
    """
    if len(cluster.pools) > 1:  # every combination of the pools' nodes (the bounds are of one kind)
        candidates = candidate_clusters(cluster, max_nodes)
        sweep = _Sweep(lambda k: _plan_cluster(workload, cost_model, options, candidates[k]), progress)
        return tuple(sweep(k) for k in range(len(candidates))), ""
    nodes = _max_nodes(cluster, max_nodes)
    per_node = cluster.gpus_per_node
    plan = _Sweep(functools.partial(plan_count, workload, cluster, cost_model, options), progress)
    bounds = CountBounds.swept(workload, cluster, cost_model, nodes, options.policy.pipeline_window)
    goal, deadline, budget = objective.goal, objective.deadline, objective.budget_gpu_hours
    budget_s = math.inf if budget is None or steps is None else 3600 * budget / steps
    if bounds.work_gpu_s > budget_s:
        raise _unmeetable(
            objective,
            steps,
            "budget_gpu_hours",
            f"no count runs {steps} steps within {budget:.4g} GPU-hours: every plan's step costs at least "
            f"{bounds.work_gpu_s:.4g} GPU-seconds ({bounds.work_gpu_s * steps / 3600:.4g} GPU-hours for the job)",
        )
    start, stopped = 1, ""
    if deadline is not None:
        target = 3600 * deadline.hours / deadline.steps
        first, stopped = _first_meeting(
            plan,
            nodes,
            lambda row: row.feasible and row.step_s <= target,
            lambda k: bounds.step_s(k * per_node),
            target,
        )
        if first is None and not plan.rows:
            why = f"no count finishes {deadline.steps} steps within {_hours(deadline.hours)}: {stopped}"
            raise _unmeetable(objective, steps, "deadline", why)
        if first is None or goal is SizingGoal.DEADLINE:
            return plan.ordered(), stopped
        start = first

    def cheapest() -> float:
        """C*: the least per-step GPU-seconds of the rows from ``start`` on that meet the goal's limits."""
        costs = [
            r.gpu_seconds_per_step
            for k, r in plan.rows.items()
            if k >= start
            and r.feasible
            and r.gpu_seconds_per_step <= budget_s
            and (deadline is None or r.step_s <= target)
        ]
        return min(costs, default=math.inf)

    if goal is SizingGoal.BUDGET:
        limit, what = (lambda: budget_s), f"is within {budget:.4g} GPU-hours"
    else:
        limit, what = (lambda: min(cheapest(), budget_s)), "costs fewer GPU-seconds"
    stopped = _scan(
        plan,
        start,
        nodes,
        lambda k: bounds.floor_s * k * per_node >= limit(),
        f"a plan on more than {{gpus}} GPUs takes at least {bounds.floor_s:.4g} s a step (t_0), so none {what}",
        per_node,
    )
    return plan.ordered(), stopped


def size_fleet(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: CostModel | Callable[[ClusterSpec], CostModel],
    options: PlannerOptions = PlannerOptions(),
    objective: SizingObjective = SizingObjective(),
    *,
    max_nodes: int | None = None,
    progress: Progress | None = None,
) -> SizingResult:
    """Plan ``workload`` on the whole-node counts of ``cluster``'s kind, 1 .. K, that the objective needs
    (:func:`sweep_counts`) and choose the count it prefers (:func:`judge`; the math: the module docstring).

    Args:
        cluster: the GPU kind and GPUs per node; its ``nodes`` is K unless ``max_nodes`` is given.
        cost_model: the cost model of every count, or a function of the candidate cluster that builds
            it (the analytic model prices the gradient all-reduce by whether the cluster spans nodes).
        options: the planner's options, the same for every count.
        objective: the goal; the job's steps are :func:`job_steps`'s.
        max_nodes: K, the most nodes swept (at most :data:`~lorafleet.specs.cluster.MAX_NODES`).
        progress: told each count's row as it is planned, with the number planned so far.

    Raises:
        InputError: ``max_nodes`` out of 1 .. MAX_NODES or a budget with no job steps (``OBJECTIVE_SOURCE``),
            before any planning; :class:`SizingError` as :func:`judge` and :func:`sweep_counts` raise it.
    """
    steps = job_steps(workload, objective)
    _check_steps(objective, steps)
    rows, stopped = sweep_counts(
        workload, cluster, cost_model, options, objective, steps, max_nodes=max_nodes, progress=progress
    )
    return replace(judge(rows, objective, steps), stopped=stopped)


def _unmeetable(objective: SizingObjective, steps: int | None, field: str, why: str) -> SizingError:
    """The error of an objective no count can meet, shown by the bounds before any planning."""
    empty = SizingResult(rows=(), objective=objective, job_steps=steps, chosen=None, reason=why)
    return SizingError(OBJECTIVE_SOURCE, field, why, empty)
