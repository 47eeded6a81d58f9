"""Which mixes a fleet sizing over several pools plans: every one when they are few, else a search along chains.

A mix is a node count per pool, k = (k_1, ..., k_P) with 0 <= k_p <= K_p (the pool's ``nodes``, or
``max_nodes``) and some pool not empty: Π_p (K_p + 1) - 1 of them. ``sweep_pools`` plans the ones a goal
needs (one :class:`~lorafleet.planner.sizing_result.SizingRow` each), in time and memory bounded whatever
K_p is:

- **At most** :data:`EXHAUSTIVE_MIXES` **(64) mixes**: every one, fewest GPUs first
  (:func:`~lorafleet.planner.sizing_search.candidate_clusters`), exact as far as the planner is optimal for
  each mix (two pools of 2 and 1 nodes: 5 mixes).
- **More** (two pools of up to 4,096 nodes have 16.8 million): the one-pool search of
  :mod:`.sizing_search` along P *chains* of nested mixes, and at most :data:`MAX_MIXES_PLANNED` (64)
  mixes planned in all, each chain its share; no list of the mixes is built.

**Chains.** With w_p(l_q) the least GPU-seconds sequence q of the expected batch costs on a config of pool p,
and f_p(l_q) its least stage time there (with the least pipeline bubble, as ``CountBounds``' t_0), the pools
are ranked by W_p = Σ_q w_p(l_q), the batch's least GPU-seconds on the pool alone (times its price when every
pool has one: what a step costs on it at best): the cost and throughput ranking the one-pool bounds use.
Chain p holds pool p alone, 1 .. K_p nodes, then adds the other pools one at a time in rank order, each
1 .. K_q nodes beside the pools before it whole: two pools a and b give (1,0) .. (K_a,0), (K_a,1) .. (K_a,K_b)
and (0,1) .. (0,K_b), (1,K_b) .. (K_a,K_b). So each pool alone is searched as one pool is, and "how many H100
nodes to add to these A100s" is the tail of the A100s' chain. A mix of a chain holds the mixes before it, so
an optimal plan's step t̂ does not rise along it, and neither do the bounds of a mix k on G(k) GPUs of the
pools S(k) (found without planning, :class:`PoolBounds`):

    t̂(k) >= max(W_S / G(k), t_0,S),   W_S = Σ_q min_{p in S} w_p(l_q),   t_0,S = max_q min_{p in S} f_p(l_q)

Along each chain, as on one pool (the rules and their reasons: :mod:`.sizing_search`), j the mix's place:

- ``DEADLINE``: galloping, j = 1, 2, 4, ..., then bisection, for the chain's first mix that meets it; a mix
  whose bound misses is not planned. O(log J) mixes a chain, J = Σ_p K_p;
- ``GPU_SECONDS``: a scan until t_0,S G(k) reaches C*, the least GPU-seconds a step so far; with a price on
  every pool until t_0,S G(k) p_S / 3600 reaches the cheapest step so far (p_S the cheapest price of S(k));
- ``BUDGET``: a scan until t_0,S G(k) S / 3600 reaches the budget;
- ``DEADLINE_AND_BUDGET``: the deadline's search, then the scan from the mix it found.

A mix none of whose plans can hold some sequence (t_0,S infinite) is not planned. The rows of every chain are
judged together (:func:`~lorafleet.planner.sizing_choice.judge`). This is not exact: a mix off the chains (3
nodes of one pool beside 2 of another, neither whole) is never planned, and a scan's bound, exact on one pool,
leaves out a later mix's plan that uses few of its GPUs; the sweep's table shows every mix planned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import sequence_lower_bound
from lorafleet.planner.candidates import valid_candidates
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.sizing_objective import SizingGoal, SizingObjective, format_hours
from lorafleet.planner.sizing_result import SizingRow
from lorafleet.planner.sizing_search import (
    CountBounds,
    Progress,
    Sweep,
    candidate_clusters,
    first_meeting,
    node_limit,
    plan_cluster,
    unmeetable,
)
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Workload

EXHAUSTIVE_MIXES = 64
"""A sweep over pools plans every mix of their node counts when there are at most this many."""
MAX_MIXES_PLANNED = 64
"""The most mixes a sweep over pools plans (the search's; each chain its share)."""

Mix = tuple[int, ...]
"""Nodes per pool, in the cluster's pool order."""


def pool_limits(cluster: ClusterSpec, max_nodes: int | None) -> Mix:
    """K_p of every pool: ``max_nodes``, else its ``nodes`` (an InputError unless 1 <= K_p <= MAX_NODES)."""
    return tuple(node_limit(cluster.only(p.name), max_nodes) for p in cluster.pools)


def mix_count(limits: Mix) -> int:
    """The mixes of pools of ``limits`` nodes: Π_p (K_p + 1) - 1."""
    return math.prod(k + 1 for k in limits) - 1


def mix_cluster(cluster: ClusterSpec, mix: Mix) -> ClusterSpec:
    """The pools of ``cluster`` with ``mix``'s nodes, the empty ones left out."""
    return ClusterSpec(pools=tuple(p.model_copy(update={"nodes": n}) for p, n in zip(cluster.pools, mix) if n))


def _gpus(cluster: ClusterSpec, mix: Mix) -> int:
    return sum(n * p.gpus_per_node for p, n in zip(cluster.pools, mix, strict=True))


@dataclass(frozen=True, slots=True, eq=False)
class PoolBounds:
    """Per pool and per sequence of the expected batch, the least GPU-seconds and stage time its configs offer:
    the bounds of every mix (:meth:`of_mix`; the module docstring), found without planning."""

    gpu_s: np.ndarray
    """w_p(l_q), shape (P, Q): min over pool p's configs of g_c r_c(l_q) (inf: none holds it)."""
    floor_s: np.ndarray
    """f_p(l_q), shape (P, Q): min over pool p's configs of (1 + (pp_c - 1) / W) r_c(l_q)."""

    def of_mix(self, mix: Mix) -> CountBounds:
        """W_S and t_0,S of the pools S that ``mix`` uses (inf when some sequence fits none of their configs)."""
        present = [p for p, n in enumerate(mix) if n]
        work = self.gpu_s[present].min(axis=0)
        floor = self.floor_s[present].min(axis=0)
        return CountBounds(float(work.sum()), float(floor.max(initial=0.0)))

    @classmethod
    def of(
        cls,
        workload: Workload,
        cluster: ClusterSpec,
        cost_model: CostModel | Callable[[ClusterSpec], CostModel],
        limits: Mix,
        window: int,
    ) -> PoolBounds:
        """Each pool alone, over the configs of its K_p nodes, by the cost models of one node and of K_p (as
        ``CountBounds.swept``), in pipeline windows of ``window`` steps."""
        lengths = expected_global_batch(workload).lengths
        gpu_s, floor_s = [], []
        for p, limit in enumerate(limits):
            alone = [tuple(n if q == p else 0 for q in range(len(limits))) for n in (1, limit)]
            largest = mix_cluster(cluster, alone[1])
            models = [cost_model(mix_cluster(cluster, m)) for m in alone] if callable(cost_model) else [cost_model]
            work, floor = np.full(len(lengths), np.inf), np.full(len(lengths), np.inf)
            for model in models:
                for c in valid_candidates(model, largest):
                    r = sequence_lower_bound(model, c.config, c.max_tokens, lengths)
                    work = np.minimum(work, c.n_gpus * r)
                    floor = np.minimum(floor, (1 + (c.config.pp - 1) / window) * r)
            gpu_s.append(work)
            floor_s.append(floor)
        return cls(np.array(gpu_s).reshape(len(limits), -1), np.array(floor_s).reshape(len(limits), -1))


class _Capped(Exception):
    """A chain asked for a mix beyond its share of :data:`MAX_MIXES_PLANNED`."""


class _Chain:
    """The mixes of one chain by their place j = 1 .. J (the module docstring), planned through ``mixes``, at
    most ``share`` of them new."""

    def __init__(self, segments: list[int], limits: Mix, mixes: Sweep[Mix], share: int) -> None:
        self.segments, self.limits, self.mixes, self.share = segments, limits, mixes, share
        self.length = sum(limits)
        self.rows: dict[int, SizingRow] = {}
        self.new = 0

    def mix(self, j: int) -> Mix:
        counts, left = [0] * len(self.limits), j
        for p in self.segments:
            counts[p] = min(left, self.limits[p])
            left -= counts[p]
        return tuple(counts)

    def __call__(self, j: int) -> SizingRow:
        mix = self.mix(j)
        if mix not in self.mixes.rows:
            if self.new >= self.share:
                raise _Capped
            self.new += 1
        self.rows[j] = self.mixes(mix)
        return self.rows[j]


def _chains(cluster: ClusterSpec, limits: Mix, bounds: PoolBounds) -> list[list[int]]:
    """Each chain's pools in the order it adds them: every pool first once, the others in rank order (the
    least W_p, times its price when every pool has one, first; ties in pool order)."""
    work = [float(w) for w in bounds.gpu_s.sum(axis=1)]
    if cluster.priced:  # a pool that cannot hold the batch is last, whatever its price
        work = [w * p.price_per_gpu_hour if math.isfinite(w) else w for w, p in zip(work, cluster.pools)]
    ranked = sorted(range(len(limits)), key=lambda p: (work[p], p))
    return [[lead, *(p for p in ranked if p != lead)] for lead in ranked]


@dataclass(frozen=True, slots=True, eq=False)
class _Goal:
    """What a chain's search asks of a mix: its bound, whether its row keeps the goal's limits, and when a
    scan may stop (the module docstring)."""

    cluster: ClusterSpec
    bounds: PoolBounds
    mixes: Sweep[Mix]
    goal: SizingGoal
    target_s: float
    """The deadline's step time (inf: none)."""
    budget_s: float
    """The budget's GPU-seconds a step (inf: none)."""

    @property
    def money(self) -> bool:
        """Whether the goal is the cheapest step at the pools' prices (``judge``'s, ``by_cost``)."""
        return self.goal is SizingGoal.GPU_SECONDS and self.cluster.priced

    def lowest(self, mix: Mix) -> float:
        """The least step time of a plan of ``mix``: max(W_S / G, t_0,S)."""
        return self.bounds.of_mix(mix).step_s(_gpus(self.cluster, mix))

    def in_time(self, row: SizingRow) -> bool:
        """The row has a plan within the deadline (what the deadline's search looks for, as on one pool)."""
        return row.feasible and row.step_s <= self.target_s

    def keeps(self, row: SizingRow) -> bool:
        """The row has a plan within the deadline and the budget (those there are)."""
        return row.feasible and row.gpu_seconds_per_step <= self.budget_s and row.step_s <= self.target_s

    def cheapest(self) -> float:
        """C*: the least per-step GPU-seconds (money, when the goal counts it) of the rows that keep the limits."""
        rows = [r for r in self.mixes.rows.values() if self.keeps(r)]
        return min((r.cost_per_step if self.money else r.gpu_seconds_per_step for r in rows), default=math.inf)

    def enough(self, mix: Mix) -> bool:
        """No later mix of a chain on more GPUs than ``mix`` can do better: t_0,S G (x p_S / 3600 in money)
        reaches C* (the budget's, for ``BUDGET``)."""
        least = self.bounds.of_mix(mix).floor_s * _gpus(self.cluster, mix)
        if self.money:
            price = min(p.price_per_gpu_hour for p, n in zip(self.cluster.pools, mix, strict=True) if n)
            return least * price / 3600 >= self.cheapest()
        return least >= (self.budget_s if self.goal is SizingGoal.BUDGET else min(self.cheapest(), self.budget_s))

    def search(self, chain: _Chain) -> None:
        """Plan the mixes of ``chain`` the goal needs: the deadline's galloping and bisection, then (unless the
        deadline is the goal) a scan until :meth:`enough`. Raises _Capped past the chain's share."""
        start = 1
        if self.target_s < math.inf:
            first, _ = first_meeting(
                chain, chain.length, self.in_time, lambda j: self.lowest(chain.mix(j)), self.target_s
            )
            if first is None or self.goal is SizingGoal.DEADLINE:
                return
            start = first
        for j in range(start, chain.length + 1):
            mix = chain.mix(j)
            if not math.isfinite(self.bounds.of_mix(mix).floor_s):
                continue  # no plan: some sequence fits none of these pools' configs
            chain(j)
            if self.enough(mix):
                return


def sweep_pools(
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
    """The rows of the mixes of ``cluster``'s pools that ``objective``'s goal needs planned, fewest GPUs first
    (then more nodes of the earlier pools), and why the sweep planned no more (empty when it planned every
    mix). Arguments as ``size_fleet``'s; the module docstring says which mixes.

    Raises:
        SizingError: the bounds show that no mix can meet the deadline or the budget (a sweep of no rows).
        InputError: ``max_nodes`` out of 1 .. MAX_NODES.
    """
    limits = pool_limits(cluster, max_nodes)
    total = mix_count(limits)
    if total <= EXHAUSTIVE_MIXES:
        candidates = candidate_clusters(cluster, max_nodes)
        return tuple(plan_cluster(workload, cost_model, options, c) for c in candidates), ""
    mixes = Sweep(lambda mix: plan_cluster(workload, cost_model, options, mix_cluster(cluster, mix)), progress)
    bounds = PoolBounds.of(workload, cluster, cost_model, limits, options.policy.pipeline_window)
    whole = bounds.of_mix(limits)
    if not math.isfinite(whole.floor_s):  # some sequence fits no config of any pool: the planner says which
        mixes(limits)
        return _ordered(cluster, mixes), ""
    deadline, budget = objective.deadline, objective.budget_gpu_hours
    goal = _Goal(
        cluster=cluster,
        bounds=bounds,
        mixes=mixes,
        goal=objective.goal,
        target_s=math.inf if deadline is None else 3600 * deadline.hours / deadline.steps,
        budget_s=math.inf if budget is None or steps is None else 3600 * budget / steps,
    )
    if whole.work_gpu_s > goal.budget_s:
        why = (
            f"no mix runs {steps} steps within {budget:.4g} GPU-hours: every plan's step costs at least "
            f"{whole.work_gpu_s:.4g} GPU-seconds ({whole.work_gpu_s * steps / 3600:.4g} GPU-hours for the job)"
        )
        raise unmeetable(objective, steps, "budget_gpu_hours", why)
    if goal.lowest(limits) > goal.target_s:
        why = (
            f"no mix finishes {deadline.steps} steps within {format_hours(deadline.hours)}: even every pool "
            f"whole ({_gpus(cluster, limits)} GPUs) takes at least {goal.lowest(limits):.4g} s a step"
        )
        raise unmeetable(objective, steps, "deadline", why)
    orders = _chains(cluster, limits, bounds)
    share = MAX_MIXES_PLANNED // len(orders)
    capped = 0
    for order in orders:
        try:
            goal.search(_Chain(order, limits, mixes, share))
        except _Capped:
            capped += 1
    if not mixes.rows:  # every chain's share went before a mix was planned (many pools): the judge needs one
        mixes(limits)
    stopped = (
        f"{len(mixes.rows)} of the {total:,} mixes of the pools' nodes planned: a search along {len(orders)} "
        "chains (each pool alone, then the others added in turn)"
    )
    if capped:
        stopped += (
            f"; {capped} chain{'s' if capped > 1 else ''} stopped at {share} mixes (at most {MAX_MIXES_PLANNED} "
            "mixes are planned)"
        )
    return _ordered(cluster, mixes), stopped


def _ordered(cluster: ClusterSpec, mixes: Sweep[Mix]) -> tuple[SizingRow, ...]:
    """The rows, fewest GPUs first, then more nodes of the earlier pools (``candidate_clusters``' order)."""
    order = sorted(mixes.rows, key=lambda mix: (_gpus(cluster, mix), [-n for n in mix]))
    return tuple(mixes.rows[mix] for mix in order)
