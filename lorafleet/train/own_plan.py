"""A run's own plan: on one machine, ``lorafleet train`` without ``--plan`` plans for itself, as ``lorafleet plan``
would on the workload's cluster (``--gpus``/``--gpu``, ``--profile`` as given), says what it planned, and the run
keeps it as its ``<out>/plan.json`` (written with the run's other files once the directory is claimed:
``preflight.claim``). One command from a workload to adapters, as Trainer users expect.

A run over several nodes needs the same plan on every node (``lorafleet plan --json``, then ``--plan``): without
one it is one line naming ``--plan``, as it is under a torchrun of the user's own. A resume without ``--plan`` trains
by the run's own ``plan.json``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from lorafleet.errors import InputError
from lorafleet.specs.fields import ARGS

if TYPE_CHECKING:
    from lorafleet.plans import DeploymentPlan
    from lorafleet.specs.cluster import ClusterSpec
    from lorafleet.train.options import TrainOptions
    from lorafleet.workload import Workload


def with_plan_path(options: TrainOptions) -> tuple[TrainOptions, bool]:
    """``options`` naming the plan the run trains by, and whether the run makes it itself: ``--plan``; without one,
    the run's own ``<out>/plan.json`` (made by :func:`own_plan` on a fresh start, read on a resume)."""
    if options.plan is not None:
        return options, False
    if os.environ.get("WORLD_SIZE") is not None:
        raise InputError(
            ARGS,
            "--plan",
            "under a torchrun of your own, give every node the same --plan (lorafleet plan WORKLOAD --json PLAN.json)",
        )
    own = options.run_dir.plan
    if options.resume and not own.is_file():
        raise InputError(ARGS, "--plan", f"not given, and the run resumed has no plan of its own ({own})")
    return replace(options, plan=str(own)), not options.resume


def own_plan(workload: Workload, cluster: ClusterSpec, options: TrainOptions) -> DeploymentPlan:
    """The plan ``lorafleet plan`` makes for ``workload`` on ``cluster`` (one machine: an InputError naming
    ``--plan`` for several nodes), said in a line."""
    from lorafleet.assemble import workload_cost_model
    from lorafleet.planner.base_choice import plan_over_base

    nodes = sum(pool.nodes for pool in cluster.pools)
    if nodes > 1:
        raise InputError(
            ARGS,
            "--plan",
            f"not given, and the cluster has {nodes} nodes: train plans for itself on one machine only; plan once "
            "for every node (lorafleet plan WORKLOAD --json PLAN.json)",
        )
    result, choice = plan_over_base(workload, cluster, lambda over: workload_cost_model(over, cluster, options.profile))
    for line in choice.lines() if choice is not None else ():  # quantize: auto or a list: each candidate said
        print(f"lorafleet train: {line}", flush=True)
    plan = result.plan
    print(
        f"lorafleet train: no --plan: planned {plan.describe()} on {plan.describe_fleet()} (expected step "
        f"{plan.expected_makespan_s:.4g} s, {plan.solver}); the run keeps it as {options.run_dir.plan}",
        flush=True,
    )
    return plan
