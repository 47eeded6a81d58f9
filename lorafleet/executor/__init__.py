"""Executors run a StepPlan and report what happened: ``run_step(step_plan) -> StepReport``.

Two implementations share this interface and the one training loop (``lorafleet.loop``):
``simulated`` (the cost model plays the hardware) and ``torch`` (real replicas).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol, runtime_checkable

from lorafleet.plans import StepPlan, StepReport


class ExecutorKind(StrEnum):
    SIMULATED = "simulated"
    TORCH = "torch"


@runtime_checkable
class Executor(Protocol):
    """Runs one step's plan on its replicas."""

    def run_step(self, step_plan: StepPlan) -> StepReport:
        """Execute (or simulate) every replica's micro-batches; return measured times and losses."""
        ...
