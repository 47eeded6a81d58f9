"""The typed objects every stage passes on: DeploymentPlan, GlobalBatch, StepPlan, StepReport.

- The planner writes a :class:`DeploymentPlan` (which replicas of which config, on which
  GPUs, and the dispatch policy and cost model it was judged under; ``deployment``, its parts in ``parts``);
  ``simulate``, ``dispatch`` and ``train`` read it back from versioned JSON and check it
  (:mod:`lorafleet.plan_check`) before any work.
- Each step, dispatch turns a :class:`GlobalBatch` into a :class:`StepPlan`: every sequence
  assigned to one replica and one micro-batch, rows contiguous by task (``step``).
- An executor runs the StepPlan and returns a :class:`StepReport`.
"""

from lorafleet.plans.deployment import PLAN_KIND, PLAN_SCHEMA_VERSION, DeploymentPlan, plan_json_schema
from lorafleet.plans.parts import (
    PLAN_SOURCE,
    ConfigName,
    FrontierPoint,
    PlanPool,
    PolicyJson,
    ReplicaJson,
    ReplicaSpec,
    stage_gpus,
    stage_position,
)
from lorafleet.plans.step import GlobalBatch, MicroBatch, ReplicaWork, StepPlan, StepReport

__all__ = [
    "PLAN_KIND",
    "PLAN_SCHEMA_VERSION",
    "PLAN_SOURCE",
    "ConfigName",
    "DeploymentPlan",
    "FrontierPoint",
    "GlobalBatch",
    "MicroBatch",
    "PlanPool",
    "PolicyJson",
    "ReplicaJson",
    "ReplicaSpec",
    "ReplicaWork",
    "StepPlan",
    "StepReport",
    "plan_json_schema",
    "stage_gpus",
    "stage_position",
]
