"""Lower bounds of the expected step: how close a plan is to what its deployment, and the fleet, can do.

Both rest on the least stage time r_c(l) a sequence of length l adds to a replica of config
c whatever its micro-batches (``dispatch.load.sequence_lower_bound``: its per-row time plus
its token share l / M of a micro-batch's constant, which padding only raises). They assume
non-negative cost coefficients (fits and the analytic model have them) and leave out the
pipeline bubble (and the fleet bound the per-step overhead), so they are bounds, not estimates:

- **deployment**: the LP of :func:`lorafleet.dispatch.balance.fluid_bound` on the plan's own
  replicas: the expected batch split over them with perfect balance and no padding, plus the
  least per-step overhead of its configs (some replica is busy; which ones, a bound cannot know,
  so it cannot charge each busy replica's own overhead or bubble). Two terms it leaves out do not
  tighten it at service scale (docs/planner.md, "The value left at service scale"): a whole
  sequence on its fastest config, and the sequences only one config holds, ceil(n / p) of them on
  one of its replicas;
- **fleet**: no deployment of the cluster's N GPUs can do better than

      T >= (1 / N) * sum_q min_c  g_c * r_c(l_q)

  (every sequence on the config where it costs the fewest GPU-seconds, g_c its GPUs, and all
  N GPUs busy the whole step): what the hardware can physically do for this batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import bucket_load, config_classes, fluid_bound, sequence_lower_bound
from lorafleet.planner.problem import Candidate
from lorafleet.plans import DeploymentPlan, GlobalBatch
from lorafleet.specs.dispatch import MicroBatchMode


@dataclass(frozen=True)
class StepBounds:
    """Lower bounds of one batch's step time, seconds."""

    deployment_s: float
    """The plan's replicas, perfectly balanced, no padding (0 when the LP could not bound)."""
    fleet_s: float
    """Any deployment of the cluster's GPUs."""


def fleet_bound(batch: GlobalBatch, candidates: Sequence[Candidate], cost_model: CostModel, n_gpus: int) -> float:
    """(1/N) * sum_q min_c g_c r_c(l_q) over the configs that hold sequence q (module docstring), seconds."""
    if len(batch) == 0 or not candidates:
        return 0.0
    per_config = np.stack(
        [c.n_gpus * sequence_lower_bound(cost_model, c.config, c.max_tokens, batch.lengths) for c in candidates]
    )
    return float(per_config.min(axis=0).sum() / n_gpus)


def step_bounds(
    plan: DeploymentPlan, batch: GlobalBatch, candidates: Sequence[Candidate], cost_model: CostModel, n_gpus: int
) -> StepBounds:
    """Both bounds of ``batch`` for ``plan`` on a cluster of ``n_gpus`` offering ``candidates``."""
    packed = replace(
        plan.policy.options, microbatch_mode=MicroBatchMode.PACKING
    )  # no padding, whatever the plan's mode
    _, load = bucket_load(batch, config_classes(plan, cost_model), cost_model, packed)
    return StepBounds(deployment_s=fluid_bound(load), fleet_s=fleet_bound(batch, candidates, cost_model, n_gpus))
