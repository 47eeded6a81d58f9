"""The event-aware plan source: the step plans of the tasks present, on one plan, for ``loop.run_loop``.

A step draws each present task's ``batch_size`` lengths by the one sampling rule
(:func:`lorafleet.sampling.task_lengths`) at the task's *own* step, so a task sees the same batches
whenever it runs and whatever else is present. The batch is dispatched on the plan
(:func:`lorafleet.dispatch.dispatch_step`, the plan's own policy) at the loop's speed factors.

The source serves one *segment* of a replay: a plan and a task set that does not change while it runs
(the replay ends the segment at a change). The loop runs the plan's pipeline windows; so that a change
still takes effect at the step boundary it is due at, :meth:`TraceSource.next_boundary` ends a window
after the step at whose end the next event is due. It knows that before the window runs by planning the
window's steps ahead (at the speed the loop will ask for, the recalibrator's) and adding their estimated
makespans to the clock. On the noise-free simulated executor a step's makespan is its estimate, so the
window ends exactly there; were they to differ, the event would apply at the window boundary after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lorafleet.arrivals.fleet import Fleet
from lorafleet.costmodel import CostModel
from lorafleet.dispatch import Recalibrator, dispatch_step
from lorafleet.plans import DeploymentPlan, StepPlan
from lorafleet.sampling import global_batch, task_lengths
from lorafleet.workload import Task


class TraceSource:
    """A :class:`~lorafleet.loop.StepPlanSource` of one segment of a replay (module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        plan: DeploymentPlan,
        cost_model: CostModel,
        tasks: Mapping[str, Task],
        seed: int,
        recalibrator: Recalibrator,
    ) -> None:
        self.fleet, self.plan, self.cost_model, self.tasks, self.seed = fleet, plan, cost_model, tasks, seed
        self.recalibrator = recalibrator
        self._ahead: dict[int, tuple[tuple[float, ...] | None, StepPlan]] = {}

    def _dispatch(self, step: int, speed: Sequence[float] | None) -> StepPlan:
        index = {n: k for k, n in enumerate(self.plan.tasks)}
        draws = []
        for name in self.fleet.present:
            own = self.fleet.own_step(name, step)
            draws.append((index[name], own, task_lengths(self.tasks[name], own, self.seed)))
        return dispatch_step(global_batch(step, draws), self.plan, self.cost_model, speed=speed)

    def plan_for(self, step: int, speed: Sequence[float] | None = None) -> StepPlan:
        """Step ``step``'s plan: the present tasks' batches (task ids index ``plan.tasks``) dispatched at ``speed``."""
        speed = None if speed is None else tuple(speed)
        planned, step_plan = self._ahead.pop(step, (None, None))
        if step_plan is not None and planned == speed:
            return step_plan
        return self._dispatch(step, speed)

    def next_boundary(self, step: int) -> int | None:
        """The step a window from ``step`` must end at for the next event to apply at its step boundary: one
        after the first step at whose (estimated) end it is due; None when it is not due within the window."""
        due = self.fleet.next_event_s
        if due is None:
            return None
        speed = self.recalibrator.factors
        clock = self.fleet.clock
        for s in range(step, step + min(self.plan.loop_window, self.fleet.first_departure())):
            step_plan = self._dispatch(s, speed)
            self._ahead[s] = (speed, step_plan)
            clock += step_plan.estimated_makespan_s
            if due <= clock:
                return s + 1
        return None
