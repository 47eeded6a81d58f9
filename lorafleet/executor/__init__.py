"""Executors run StepPlans and report what happened: ``run_steps(step_plans) -> [StepReport]``.

Two implementations share this interface and the one training loop (``lorafleet.loop``):
``simulated`` (the cost model plays the hardware) and ``torch`` (real replicas).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol, runtime_checkable

from lorafleet.plans import StepPlan, StepReport


class ExecutorKind(StrEnum):
    SIMULATED = "simulated"
    TORCH = "torch"


@runtime_checkable
class Executor(Protocol):
    """Runs consecutive steps' plans on its replicas."""

    def run_steps(self, step_plans: Sequence[StepPlan]) -> list[StepReport]:
        """Execute (or simulate) every replica's micro-batches of consecutive steps, as one pipeline
        window (``costmodel.schedule``); return each step's measured times and losses."""
        ...
