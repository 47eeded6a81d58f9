"""The plan source of a replay's steps: the step plans of the tasks present, on one plan, for ``loop.run_loop``.

A step draws each present task's ``batch_size`` lengths by the one sampling rule
(:func:`lorafleet.sampling.task_lengths`) at the task's *own* step, so a task sees the same batches
whenever it runs and whatever else is present. The batch is dispatched on the plan
(:func:`lorafleet.dispatch.dispatch_step`, the plan's own policy) at the loop's speed factors.

The source serves one *segment* of a replay: a plan and a task set that does not change while it runs
(the replay ends the segment at a change). It knows nothing of the trace's events: as ``lorafleet train``
reads its queue only at window boundaries (a request it has not seen cannot end a window), an event ends no
window, and is applied at the first window boundary at or after it (``arrivals.replay``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lorafleet.arrivals.fleet import Fleet
from lorafleet.costmodel import CostModel
from lorafleet.dispatch import dispatch_step
from lorafleet.plans import DeploymentPlan, StepPlan
from lorafleet.sampling import global_batch, task_lengths
from lorafleet.workload import Task


class TraceSource:
    """A :class:`~lorafleet.loop.StepPlanSource` of one segment of a replay (module docstring)."""

    def __init__(
        self, fleet: Fleet, plan: DeploymentPlan, cost_model: CostModel, tasks: Mapping[str, Task], seed: int
    ) -> None:
        self.fleet, self.plan, self.cost_model, self.tasks, self.seed = fleet, plan, cost_model, tasks, seed

    def plan_for(self, step: int, speed: Sequence[float] | None = None) -> StepPlan:
        """Step ``step``'s plan: the present tasks' batches (task ids index ``plan.tasks``) dispatched at ``speed``."""
        index = {n: k for k, n in enumerate(self.plan.tasks)}
        draws = []
        for name in self.fleet.present:
            own = self.fleet.own_step(name, step)
            draws.append((index[name], own, task_lengths(self.tasks[name], own, self.seed)))
        return dispatch_step(global_batch(step, draws), self.plan, self.cost_model, speed=speed)
