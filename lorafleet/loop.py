"""The one step loop every executor runs under: get the step's plan, run it, record it.

The plan source computes plans ahead (``lorafleet.dispatch.LookaheadDispatcher`` starts
step t+1 while step t runs); the executor is simulated or real. The loop itself knows
neither, which is what lets a what-if and a training run share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from lorafleet.costmodel import CostModel
from lorafleet.executor import Executor
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan, StepReport
from lorafleet.planner import DispatchPolicy


class StepPlanSource(Protocol):
    """Where step plans come from (``LookaheadDispatcher`` is one)."""

    def plan_for(self, step: int) -> StepPlan:
        """Step ``step``'s plan."""
        ...


@dataclass(frozen=True)
class PolicySource:
    """Step plans of one deployment under a planner's :class:`DispatchPolicy` (static or dynamic buckets)."""

    batch_for_step: Callable[[int], GlobalBatch]
    plan: DeploymentPlan
    cost_model: CostModel
    policy: DispatchPolicy

    def plan_for(self, step: int) -> StepPlan:
        return self.policy.dispatch(self.batch_for_step(step), self.plan, self.cost_model)


def run_loop(
    source: StepPlanSource,
    executor: Executor,
    steps: Iterable[int],
    on_report: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """Run ``steps`` in order; every StepReport goes to ``on_report`` as soon as it exists."""
    reports = []
    for step in steps:
        report = executor.run_step(source.plan_for(step))
        if on_report is not None:
            on_report(report)
        reports.append(report)
    return reports
