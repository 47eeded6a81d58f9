"""What a running fleet does when its task set changes at a step boundary: one pure rule, shared by
``lorafleet train`` (``train.changes``, on rank 0) and ``lorafleet simulate --arrivals`` (``arrivals.replay``).

The rule, in two calls:

1. :func:`decide`, at the change's boundary ``S``. When only a share or a deadline changed (no task joins or
   leaves, and no re-plan under way is superseded) the running deployment serves on: :class:`Keep`, no re-plan.
   Otherwise, when the running deployment can serve the new tasks (``kept``: every expected sequence fits a
   replica, ``planner.incremental.kept_plan``) and moves may wait (``replan_after > 0``), the tasks run on it
   at once and the incremental re-plan runs beside the next steps: :class:`Keep` with ``replan_at = S +
   replan_after``, the boundary its answer is applied at, a fixed step whatever the planner's speed. Else the
   boundary itself re-plans and the fleet waits for it: :class:`ReplanNow`.
2. :func:`settle`, with a re-plan's answer (at ``S`` for :class:`ReplanNow`, at ``replan_at`` for a re-plan beside
   the steps): :class:`Move` to its plan, or :class:`Keep` the running deployment, or, when the plan needs
   more processes than the fleet has, :class:`HandOff` to whoever can start them (the launcher: the workers
   stop at a committed checkpoint and are started again on the new plan).

A change of the task set at a boundary while a re-plan runs beside the steps supersedes it: its answer was for
the tasks before, so it is never applied, and the new change is decided from the running deployment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lorafleet.planner.incremental import Replan
from lorafleet.plans import DeploymentPlan


@dataclass(frozen=True)
class Keep:
    """The fleet runs ``plan``, its running deployment (the new tasks' slots changed in place)."""

    plan: DeploymentPlan
    replan_at: int | None = None
    """The boundary the re-plan running beside the steps answers at (None: no re-plan)."""


@dataclass(frozen=True)
class ReplanNow:
    """The boundary re-plans now; the fleet waits for the answer (then :func:`settle`)."""


@dataclass(frozen=True)
class Move:
    """The fleet moves to ``plan``: the ranks whose stage changes build it in place."""

    plan: DeploymentPlan


@dataclass(frozen=True)
class HandOff:
    """``plan`` needs more processes than the fleet has: the workers stop and the launcher starts them again."""

    plan: DeploymentPlan


def decide(
    step: int,
    tasks_changed: bool,
    kept: Callable[[], DeploymentPlan | None],
    running: DeploymentPlan,
    replan_after: int,
) -> Keep | ReplanNow:
    """Rule 1 of the module doc at the boundary before ``step``. ``tasks_changed``: a task joins or leaves, or a
    re-plan under way is superseded; ``kept()``: the running deployment serving the new tasks (None: it cannot),
    asked only when needed; ``running``: the deployment now, with the new task list (what an update alone runs
    on). The caller starts no re-plan whose ``replan_at`` is at or past the end of its run with the new tasks
    (the answer would never apply): it keeps the deployment without one."""
    if not tasks_changed:
        return Keep(running)
    plan = kept() if replan_after else None
    if plan is None:
        return ReplanNow()
    return Keep(plan, step + replan_after)


def settle(answer: Replan, world_size: int | None = None) -> Keep | Move | HandOff:
    """Rule 2 of the module doc: a re-plan's ``answer`` for a fleet of ``world_size`` processes (None: as many as
    a plan asks for)."""
    if not answer.moved:
        return Keep(answer.plan)
    if world_size is not None and answer.plan.world_size > world_size:
        return HandOff(answer.plan)
    return Move(answer.plan)
