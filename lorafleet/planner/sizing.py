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

**Pools.** On a cluster of several pools the candidates are the mixes of each pool's node count, 0 .. its
``nodes`` (or ``max_nodes``), some pool not empty: every one when there are at most 64, else those a search
along each pool's chain of nested mixes plans, at most 64 (:mod:`.sizing_pools`; two pools of 4,096 nodes
have 16.8 million mixes): "how many H100 nodes to add to these A100s" is the rows with the A100 pool
whole. With a price on every pool such a sweep counts money where it
counts GPUs: with P(n) what candidate n's plan costs a second at its pools' prices
(``accounting.price_per_second``), the GPU-seconds goal becomes the cheapest step, argmin_lex
(t̂(n) P(n), n), and the deadline goal the cheapest step that finishes in time, argmin_lex
{ (t̂(n) P(n), n) : t̂(n) S_d <= 3600 H_d } (a budget stays in GPU-hours). On one pool money is
proportional to GPU-seconds, and the goals stand as above.

When no count qualifies, :class:`SizingError` (an InputError) says which limit was missed and
by how much, and carries the sweep. ``size_fleet`` is :func:`sweep_counts` (the planning, one row
per count planned) then :func:`judge` (the choice, pure: the same rows can be judged for other goals).

**The modules.** This one holds ``size_fleet``; the rest of the sizing is in five modules of one concern each:

- :mod:`.sizing_objective`: the goal (``SizingObjective``, ``Deadline``, ``SizingGoal``) and the job's steps;
- :mod:`.sizing_result`: one count's row (``SizingRow``: its plan and figures) and a sweep's result and error
  (``SizingResult``, ``SizingError``);
- :mod:`.sizing_search`: which counts of one pool are planned (the candidates, the lower bounds ``CountBounds``,
  the galloping search and the scans: ``sweep_counts``, ``plan_counts``);
- :mod:`.sizing_pools`: which mixes of several pools' nodes are planned (every one, or the search along chains:
  ``sweep_pools``);
- :mod:`.sizing_choice`: the count each goal picks from the rows (``judge``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.sizing_choice import judge
from lorafleet.planner.sizing_objective import SizingObjective, check_steps, job_steps
from lorafleet.planner.sizing_pools import sweep_pools
from lorafleet.planner.sizing_result import SizingResult
from lorafleet.planner.sizing_search import Progress, sweep_counts
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Workload


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
    (:func:`sweep_counts`; the mixes of several pools' nodes: :func:`sweep_pools`) and choose the count it
    prefers (:func:`judge`; the math: the module docstring).

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
    check_steps(objective, steps)
    sweep = sweep_pools if len(cluster.pools) > 1 else sweep_counts
    rows, stopped = sweep(
        workload, cluster, cost_model, options, objective, steps, max_nodes=max_nodes, progress=progress
    )
    return replace(judge(rows, objective, steps), stopped=stopped)
