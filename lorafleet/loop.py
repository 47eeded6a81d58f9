"""The one step loop every executor runs under: get the step's plan, run it, learn from it, record it.

The plan source computes plans ahead (``lorafleet.dispatch.LookaheadDispatcher`` starts
step t+1 while step t runs); the executor is simulated or real. After every step the
:class:`~lorafleet.dispatch.recalibration.Recalibrator` folds the measured replica times into
per-replica corrections of the cost model, which price the plans the source computes from
then on (the StepReport loop of DESIGN.md). The loop itself knows neither source nor
executor, which is what lets a what-if and a training run share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lorafleet.costmodel import CostModel
from lorafleet.dispatch import Recalibrator, dispatch_step
from lorafleet.executor import Executor
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan, StepReport


class StepPlanSource(Protocol):
    """Where step plans come from (``LookaheadDispatcher`` is one)."""

    def plan_for(self, step: int, speed: Sequence[float] | None = None) -> StepPlan:
        """Step ``step``'s plan; plans the source starts from now on price replicas at ``speed``."""
        ...


@dataclass(frozen=True)
class PolicySource:
    """Step plans of one deployment under its plan's policy, computed when asked (no look-ahead)."""

    batch_for_step: Callable[[int], GlobalBatch]
    plan: DeploymentPlan
    cost_model: CostModel

    def plan_for(self, step: int, speed: Sequence[float] | None = None) -> StepPlan:
        return dispatch_step(self.batch_for_step(step), self.plan, self.cost_model, speed=speed)


def run_loop(
    source: StepPlanSource,
    executor: Executor,
    steps: range,
    on_report: Callable[[StepReport, StepPlan], None] | None = None,
    recalibrator: Recalibrator | None = None,
    stop: Callable[[], bool] | None = None,
    window: int = 1,
    boundary_every: int | None = None,
    next_boundary: Callable[[int], int | None] | None = None,
) -> list[StepReport]:
    """Run ``steps`` in order, in windows of up to ``window`` steps (``Executor.run_steps``: a
    pipelined replica streams a window without draining between its steps), a window also ending
    at every multiple of ``boundary_every`` (the checkpoint cadence). Every StepReport (with the
    plan it ran) goes to ``on_report`` once its window has run, after ``recalibrator`` has learnt
    from it. ``stop`` is asked before each window (a window boundary): when it says so, the loop
    ends there. ``next_boundary(step)``, when given, names a step after ``step`` a window must also end at
    (a queued change due then), or None."""
    reports: list[StepReport] = []
    step = steps.start
    while step < steps.stop:
        if stop is not None and stop():
            break
        end = min(steps.stop, step + window)
        if boundary_every:
            end = min(end, (step // boundary_every + 1) * boundary_every)
        forced = next_boundary(step) if next_boundary is not None else None
        if forced is not None and forced > step:
            end = min(end, forced)
        speed = recalibrator.factors if recalibrator is not None else None
        plans = [source.plan_for(s, speed) for s in range(step, end)]
        for report, step_plan in zip(executor.run_steps(plans), plans, strict=True):
            if recalibrator is not None:
                recalibrator.observe(step_plan, report)
            if on_report is not None:
                on_report(report, step_plan)
            reports.append(report)
        step = end
    return reports
