"""The goal of a fleet sizing (``plan --gpus auto``): a deadline, a GPU-hour budget, both, or neither.

``SizingObjective`` holds the goal and ``SizingGoal`` names it (the math of each: :mod:`.sizing`);
``job_steps`` is the job's steps S, ``check_steps`` refuses a budget without them, and
``describe_objective`` says the goal in words. An InputError about the objective names
:data:`OBJECTIVE_SOURCE` and the objective's field (a command maps them to its flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from lorafleet.errors import InputError
from lorafleet.workload import Workload

OBJECTIVE_SOURCE = "<sizing objective>"
"""The source an InputError about the objective names; its fields are ``deadline``,
``budget_gpu_hours``, ``steps`` and ``max_nodes`` (a command maps them to its flags)."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """``steps`` training steps within ``hours`` hours of wall clock."""

    steps: int
    hours: float

    def __post_init__(self) -> None:
        if not self.steps >= 1:
            raise InputError(OBJECTIVE_SOURCE, "deadline", f"steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.hours) and self.hours > 0):
            raise InputError(OBJECTIVE_SOURCE, "deadline", f"hours must be > 0, got {self.hours}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SizingObjective:
    """The goal of a sizing: a deadline, a GPU-hour budget, both, or neither (fewest GPU-seconds)."""

    deadline: Deadline | None = None
    budget_gpu_hours: float | None = None
    steps: int | None = None
    """The job's steps where no deadline gives them; None: the workload's (:func:`job_steps`)."""

    def __post_init__(self) -> None:
        budget = self.budget_gpu_hours
        if budget is not None and not (math.isfinite(budget) and budget > 0):
            raise InputError(OBJECTIVE_SOURCE, "budget_gpu_hours", f"must be > 0 GPU-hours, got {budget}")
        if self.steps is not None and self.steps < 1:
            raise InputError(OBJECTIVE_SOURCE, "steps", f"must be >= 1, got {self.steps}")
        if self.steps is not None and self.deadline is not None:
            given = self.deadline.steps
            raise InputError(OBJECTIVE_SOURCE, "steps", f"the deadline gives the steps ({given}); give one of them")

    @property
    def goal(self) -> SizingGoal:
        if self.deadline is not None and self.budget_gpu_hours is not None:
            return SizingGoal.DEADLINE_AND_BUDGET
        if self.deadline is not None:
            return SizingGoal.DEADLINE
        if self.budget_gpu_hours is not None:
            return SizingGoal.BUDGET
        return SizingGoal.GPU_SECONDS


class SizingGoal(StrEnum):
    """What the chosen count is best at (the math: :mod:`.sizing`)."""

    GPU_SECONDS = "gpu-seconds"
    DEADLINE = "deadline"
    BUDGET = "budget"
    DEADLINE_AND_BUDGET = "deadline+budget"


def describe_objective(objective: SizingObjective, priced: bool = False) -> str:
    """``fewest GPUs for 2000 steps in 1.5 h``: the goal in words (``priced``: a sweep over pools with prices)."""
    deadline, budget = objective.deadline, objective.budget_gpu_hours
    least = "cheapest" if priced else "fewest GPUs"
    return {
        SizingGoal.GPU_SECONDS: lambda: "cheapest at the pools' prices" if priced else "fewest GPU-seconds",
        SizingGoal.DEADLINE: lambda: f"{least} for {deadline.steps} steps in {format_hours(deadline.hours)}",
        SizingGoal.BUDGET: lambda: f"fastest within {budget:.4g} GPU-hours",
        SizingGoal.DEADLINE_AND_BUDGET: lambda: (
            f"fewest GPU-hours for {deadline.steps} steps in {format_hours(deadline.hours)} "
            f"within {budget:.4g} GPU-hours"
        ),
    }[objective.goal]()


def job_steps(workload: Workload, objective: SizingObjective) -> int | None:
    """The job's steps: the deadline's, else ``objective.steps``, else the last step a task of the
    workload is given (its ``start_step + steps``, largest over the tasks that set ``steps``), else None."""
    if objective.deadline is not None:
        return objective.deadline.steps
    if objective.steps is not None:
        return objective.steps
    ends = [t.spec.start_step + t.spec.steps for t in workload.tasks if t.spec.steps is not None]
    return max(ends, default=None)


def check_steps(objective: SizingObjective, steps: int | None) -> None:
    """An InputError (``OBJECTIVE_SOURCE``, ``steps``) for a budget with no job ``steps``: its GPU-hours need S."""
    if objective.budget_gpu_hours is not None and steps is None:
        raise InputError(
            OBJECTIVE_SOURCE,
            "steps",
            "a GPU-hour budget needs the job's steps: none given, and no task of the workload sets steps",
        )


def format_hours(h: float) -> str:
    """``1.5 h``: hours as the sizing's messages print them."""
    return f"{h:.3g} h"
