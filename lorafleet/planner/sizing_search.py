"""Which counts a fleet sizing plans: the candidate clusters, the lower bounds, and the search over them.

``sweep_counts`` plans the counts of one pool a goal needs (one
:class:`~lorafleet.planner.sizing_result.SizingRow` each), ``plan_counts`` every candidate, ``plan_count``
one; ``candidate_clusters`` lists the candidates (whole nodes of one pool, or every combination of several
pools' nodes, at most MAX_NODES of them). Over several pools the search is :mod:`.sizing_pools`', which runs
this one's galloping search (``first_meeting``) along chains of mixes.

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

(t̂, G, C, S and the goals: :mod:`.sizing`.) A sweep over several pools: :mod:`.sizing_pools`.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import sequence_lower_bound
from lorafleet.errors import InputError
from lorafleet.planner.bounds import fleet_bound
from lorafleet.planner.candidates import valid_candidates
from lorafleet.planner.driver import plan_deployment
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.sizing_objective import OBJECTIVE_SOURCE, SizingGoal, SizingObjective, format_hours
from lorafleet.planner.sizing_result import SizingError, SizingResult, SizingRow
from lorafleet.specs.cluster import MAX_NODES, ClusterSpec
from lorafleet.workload import Workload


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
    return tuple(plan_cluster(workload, cost_model, options, c) for c in candidate_clusters(cluster, max_nodes))


def node_limit(cluster: ClusterSpec, max_nodes: int | None) -> int:
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
    return plan_cluster(workload, cost_model, options, _candidate(cluster, k))


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


K = TypeVar("K")
Progress = Callable[[SizingRow, int], None]
"""Told each row as it is planned, with the number of counts planned so far."""


class Sweep(Generic[K]):
    """The fleets planned so far, each once, by key (a node count here, a mix of pools' nodes in ``sizing_pools``):
    a search may ask for one again, and a pool's chains share many."""

    def __init__(self, plan: Callable[[K], SizingRow], progress: Progress | None) -> None:
        self._plan = plan
        self._progress = progress
        self.rows: dict[K, SizingRow] = {}

    def __call__(self, k: K) -> SizingRow:
        if k not in self.rows:
            self.rows[k] = self._plan(k)
            if self._progress is not None:
                self._progress(self.rows[k], len(self.rows))
        return self.rows[k]

    def ordered(self) -> tuple[SizingRow, ...]:
        return tuple(self.rows[k] for k in sorted(self.rows))


class Planned(Protocol):
    """Plans count k once (:class:`Sweep`, or a chain of mixes: ``sizing_pools``) and holds the rows planned."""

    rows: Mapping[int, SizingRow]

    def __call__(self, k: int) -> SizingRow: ...


def first_meeting(
    plan: Planned, nodes: int, meets: Callable[[SizingRow], bool], lowest: Callable[[int], float], target_s: float
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


def _scan(plan: Sweep[int], start: int, nodes: int, enough: Callable[[int], bool], why: str, per_node: int) -> str:
    """Plan the counts start, start + 1, ... up to ``nodes`` until ``enough(k)`` after planning k; why it stopped
    (``why`` with ``{gpus}``, k's GPUs; empty when it reached ``nodes``)."""
    for k in range(start, nodes + 1):
        plan(k)
        if k < nodes and enough(k):
            return f"stopped after {k * per_node} GPUs: {why.format(gpus=k * per_node)}"
    return ""


def candidate_clusters(cluster: ClusterSpec, max_nodes: int | None = None) -> list[ClusterSpec]:
    """Every cluster a sweep may plan: every combination of each pool's 0 .. K_p nodes (K_p its ``nodes``, or
    ``max_nodes``) with some pool not empty, the empty pools left out; fewest GPUs first, then more nodes of
    the earlier pools. (One pool: its whole-node counts 1 .. K, :func:`_candidate`.) An InputError naming
    ``max_nodes`` when the pools have more than MAX_NODES combinations (two pools of 4,096 nodes: 16.8
    million, which this list would hold in gigabytes)."""
    if len(cluster.pools) == 1:
        return [_candidate(cluster, k) for k in range(1, node_limit(cluster, max_nodes) + 1)]
    ranges = [range(0, node_limit(cluster.only(p.name), max_nodes) + 1) for p in cluster.pools]
    mixes = math.prod(len(r) for r in ranges) - 1
    if mixes > MAX_NODES:
        raise InputError(
            OBJECTIVE_SOURCE,
            "max_nodes",
            f"the pools have {mixes:,} mixes of their nodes, more than the {MAX_NODES:,} that may be listed and "
            "planned each (size_fleet searches them instead: planner.sizing_pools)",
        )
    out = []
    for counts in itertools.product(*ranges):
        pools = tuple(p.model_copy(update={"nodes": n}) for p, n in zip(cluster.pools, counts, strict=True) if n)
        if pools:
            out.append((sum(n * p.gpus_per_node for p, n in zip(cluster.pools, counts)), [-n for n in counts], pools))
    return [ClusterSpec(pools=pools) for *_, pools in sorted(out, key=lambda x: x[:2])]


def plan_cluster(
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
    if len(cluster.pools) > 1:
        raise ValueError("a sweep over several pools is planner.sizing_pools.sweep_pools'")
    nodes = node_limit(cluster, max_nodes)
    per_node = cluster.gpus_per_node
    plan = Sweep(functools.partial(plan_count, workload, cluster, cost_model, options), progress)
    bounds = CountBounds.swept(workload, cluster, cost_model, nodes, options.policy.pipeline_window)
    goal, deadline, budget = objective.goal, objective.deadline, objective.budget_gpu_hours
    budget_s = math.inf if budget is None or steps is None else 3600 * budget / steps
    if bounds.work_gpu_s > budget_s:
        raise unmeetable(
            objective,
            steps,
            "budget_gpu_hours",
            f"no count runs {steps} steps within {budget:.4g} GPU-hours: every plan's step costs at least "
            f"{bounds.work_gpu_s:.4g} GPU-seconds ({bounds.work_gpu_s * steps / 3600:.4g} GPU-hours for the job)",
        )
    start, stopped = 1, ""
    if deadline is not None:
        target = 3600 * deadline.hours / deadline.steps
        first, stopped = first_meeting(
            plan,
            nodes,
            lambda row: row.feasible and row.step_s <= target,
            lambda k: bounds.step_s(k * per_node),
            target,
        )
        if first is None and not plan.rows:
            why = f"no count finishes {deadline.steps} steps within {format_hours(deadline.hours)}: {stopped}"
            raise unmeetable(objective, steps, "deadline", why)
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


def unmeetable(objective: SizingObjective, steps: int | None, field: str, why: str) -> SizingError:
    """The error of an objective no count can meet, shown by the bounds before any planning."""
    empty = SizingResult(rows=(), objective=objective, job_steps=steps, chosen=None, reason=why)
    return SizingError(OBJECTIVE_SOURCE, field, why, empty)
