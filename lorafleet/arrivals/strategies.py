"""How the fleet answers a change of its task set: one small object per strategy, one interface.

Each strategy is a :class:`Replanner`: the replay asks ``on_change(running, tasks, at_s, steps_left)``
at every change (the fleet starting included) and runs the :class:`Decision`'s plan from there.

- :class:`Incremental`: :func:`lorafleet.planner.incremental.replan_incremental` from the running plan, over
  ``min(horizon, steps_left)`` steps, by its objective; when it moves, its ``migration_gpu_s`` is charged;
- :class:`Scratch`: :func:`lorafleet.planner.plan_deployment` for the present tasks, always taken, and its
  move charged;
- :class:`Static`: one plan for every task of the workload and the trace together, made up front and
  never changed: no migration, and no change recorded.

The first plan of a run (the fleet starting, ``running`` None) is a fresh plan for the tasks present,
like any other change but with nothing torn down. Every strategy prices a move alike
(``ReplanOptions.pricing``: the in-process rebuild's model, ``planner.incremental.MigrationModel``, each
rebuilt stage loaded at its pool's rate, or a flat ``--migration-s`` a replica torn down), and the fleet
waits the move's seconds (the replay's clock). Migration GPU-seconds are the fleet's, not any task's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Protocol, TypeVar

from lorafleet.arrivals.trace import Trace
from lorafleet.costmodel import CostModel
from lorafleet.errors import InputError
from lorafleet.planner import PlannerOptions, ReplanOptions, plan_deployment, replan_incremental
from lorafleet.planner.incremental import torn_down
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Workload

T = TypeVar("T")


class Strategy(StrEnum):
    """How the fleet answers a change of its task set."""

    INCREMENTAL = "incremental"
    SCRATCH = "scratch"
    STATIC = "static"


@dataclass(frozen=True)
class Change:
    """One re-plan: the task set changed at a step boundary (or the fleet started)."""

    at_s: float
    tasks: tuple[str, ...]
    """The tasks present from here on."""
    plan: str
    """The deployment that runs them (``DeploymentPlan.describe``)."""
    gpus: int
    """GPUs its replicas use."""
    moved: bool
    """The deployment changed (the first plan of a run is not a move)."""
    torn_down: int
    """Replicas of the previous deployment rebuilt."""
    migration_gpu_s: float
    """Charged for this change (0 when the deployment stayed)."""
    step_gpu_s: float
    """The chosen deployment's expected GPU-seconds per step on the new task set."""
    keep_step_gpu_s: float | None = None
    """incremental only: the running deployment's expected GPU-seconds per step on it (inf: cannot serve it)."""
    note: str = ""
    migration_s: float = 0.0
    """Seconds the fleet waits for the move before its next step (0 when the deployment stayed)."""
    step: int | None = None
    """The first global step run on ``plan`` (``changes.jsonl``'s ``step`` in a training run; a move found by a re-plan
    beside the steps: ``replan_after`` steps after the change at ``at_s``); set by the replay."""


@dataclass(frozen=True)
class Decision:
    """A strategy's answer to a change: the plan the tasks run on from here, and the change it records."""

    plan: DeploymentPlan
    change: Change | None = None
    """None: nothing to record (``static`` keeps its one plan)."""
    interim: DeploymentPlan | None = None
    """A move's running deployment serving the new tasks, which they run on first while the re-plan runs
    beside the steps (``ReplanSettings.after``; ``incremental`` only; None: no move, or it cannot)."""


class PlanMaker:
    """The plans a replay makes, cached by task list (scratch and every first plan ask for the same ones),
    with planner errors named where the task was defined."""

    def __init__(self, trace: Trace, cluster: ClusterSpec, cost_model: CostModel, options: PlannerOptions) -> None:
        self.trace, self.cluster, self.cost_model, self.options = trace, cluster, cost_model, options
        self._fresh: dict[tuple[str, ...], DeploymentPlan] = {}

    def named(self, names: Sequence[str], fn: Callable[[Workload], T]) -> T:
        """``fn`` of the workload of the tasks ``names``; an error in task k is named at its arrival."""
        workload = self.trace.subset(names)
        try:
            return fn(workload)
        except InputError as err:
            if err.path != workload.path or not err.field.startswith("tasks["):
                raise
            k, _, rest = err.field.removeprefix("tasks[").partition("]")
            path, where = self.trace.arrival(names[int(k)]).source
            raise InputError(path, where + rest, err.msg) from None

    def fresh(self, names: tuple[str, ...]) -> DeploymentPlan:
        """The planner's plan for the tasks ``names`` (made once per task list)."""
        if names not in self._fresh:
            self._fresh[names] = self.named(
                names, lambda w: plan_deployment(w, self.cluster, self.cost_model, self.options).plan
            )
        return self._fresh[names]


class Replanner(Protocol):
    """A strategy: what the fleet runs after each change of its task set."""

    strategy: ClassVar[Strategy]
    plans_made: int
    """The planner's calls so far (cached plans count: each is a plan the strategy asked for)."""

    def on_change(
        self, running: DeploymentPlan | None, tasks: tuple[str, ...], at_s: float, steps_left: int
    ) -> Decision:
        """The plan for ``tasks`` (the tasks present, in arrival order) from ``at_s`` on; ``running``: the plan
        that ran until now (None: the fleet starts); ``steps_left``: the most steps a present task has left."""
        ...


class _PlansEveryChange(ABC):
    """A strategy that plans at every change; the fleet starts on a fresh plan for the tasks present."""

    strategy: ClassVar[Strategy]

    def __init__(self, plans: PlanMaker, replan: ReplanOptions) -> None:
        self.plans, self.replan_options = plans, replan
        self.plans_made = 0

    def on_change(
        self, running: DeploymentPlan | None, tasks: tuple[str, ...], at_s: float, steps_left: int
    ) -> Decision:
        self.plans_made += 1
        if running is None:
            plan = self.plans.fresh(tasks)
            gpu_s = plan.expected_gpu_seconds
            first = Change(at_s, tasks, plan.describe(), plan.used_gpus, False, 0, 0.0, gpu_s, note="first plan")
            return Decision(plan, first)
        return self.replan(running, tasks, at_s, steps_left)

    @abstractmethod
    def replan(self, running: DeploymentPlan, tasks: tuple[str, ...], at_s: float, steps_left: int) -> Decision:
        """The answer to a change after the first plan."""


class Incremental(_PlansEveryChange):
    """Keep the running deployment unless a new plan pays for its migration (``replan_incremental``)."""

    strategy = Strategy.INCREMENTAL

    def replan(self, running: DeploymentPlan, tasks: tuple[str, ...], at_s: float, steps_left: int) -> Decision:
        plans = self.plans
        r = plans.named(
            tasks,
            lambda w: replan_incremental(
                running, w, plans.cluster, plans.cost_model, plans.options, self.replan_options, steps_left
            ),
        )
        keep = r.keep_step_s * running.used_gpus
        gone = r.torn_down if r.moved else 0
        charged = r.migration_gpu_s if r.moved else 0.0
        plan = r.plan
        chosen = plan.expected_gpu_seconds
        change = Change(
            at_s,
            tasks,
            plan.describe(),
            plan.used_gpus,
            r.moved,
            gone,
            charged,
            chosen,
            keep,
            r.describe(),
            r.migration_s,
        )
        return Decision(plan, change, r.kept if r.moved else None)


class Scratch(_PlansEveryChange):
    """A fresh plan for the tasks present, always taken, paying for every replica it tears down."""

    strategy = Strategy.SCRATCH

    def replan(self, running: DeploymentPlan, tasks: tuple[str, ...], at_s: float, steps_left: int) -> Decision:
        new = self.plans.fresh(tasks)
        gone = torn_down(running, new)
        moved = not new.same_deployment(running)
        plans = self.plans
        move = self.replan_options.pricing.price(running, new, plans.cost_model.model.n_params, plans.cluster)
        change = Change(
            at_s, tasks, new.describe(), new.used_gpus, moved, len(gone), move.gpu_s, new.expected_gpu_seconds,
            migration_s=move.wall_s,
        )  # fmt: skip
        return Decision(new, change)


class Static:
    """One plan for every task of the run, made up front and never changed."""

    strategy = Strategy.STATIC

    def __init__(self, plans: PlanMaker, replan: ReplanOptions) -> None:
        self.plan = plans.fresh(plans.trace.names)
        self.plans_made = 1

    def on_change(
        self, running: DeploymentPlan | None, tasks: tuple[str, ...], at_s: float, steps_left: int
    ) -> Decision:
        return Decision(self.plan)


REPLANNERS: dict[Strategy, Callable[[PlanMaker, ReplanOptions], Replanner]] = {
    Strategy.INCREMENTAL: Incremental,
    Strategy.SCRATCH: Scratch,
    Strategy.STATIC: Static,
}
"""Strategy -> its replanner, built from the replay's plans and re-planning options."""
