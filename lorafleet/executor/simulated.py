"""The cost model plays the hardware: step times with noise, stragglers and failures.

Replica r's busy time in a step is

    busy_r = slowdown_r * ε_r * T_r(micro-batches)          ε_r ~ LogNormal(0, σ²), E[ε] ≈ 1

where T_r is the cost model's replica time (its pipeline bubble over the plan's policy's
window, priced with the tasks each micro-batch holds; LobRA Eq. 12 plus the step overhead when
the window is one step). The step's
makespan is the slowest replica: adapter gradients are all-reduced across every replica at
the end of a step, so everyone waits for it. A failure of replica r at step t costs a
restart (``restart_s``) plus re-running the work it had done (a uniformly random fraction
of its share), the DLRover "process restart" rung; the step still completes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.plans import DeploymentPlan, StepPlan, StepReport


@dataclass(frozen=True, kw_only=True)
class FailureSpec:
    """Replica ``replica_id`` fails during step ``step``."""

    step: int
    replica_id: int
    restart_s: float = 30.0
    """Detection plus process restart plus reload of the last checkpoint, seconds."""


MAX_NOISE_SIGMA = 1.0
"""The largest noise σ: a step's factor is exp(σ Z), Z standard normal, so at σ = 1 one step in six is 2.7x
slow or fast and one in a thousand 20x; beyond that it is no longer noise but a failure (``failures``,
``slowdown``), and exp(σ Z) soon overflows a float (σ = 1000 made times infinite)."""


@dataclass(frozen=True, kw_only=True)
class SimulationOptions:
    """How the simulated hardware deviates from the cost model."""

    noise_sigma: float = 0.0
    """σ of the multiplicative log-normal noise per replica and step (0.03 = about 3%), 0 to
    :data:`MAX_NOISE_SIGMA`."""
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """Replica id -> constant factor >= 1 (a straggler)."""
    failures: Sequence[FailureSpec] = ()
    """Injected failures."""
    seed: int = 0
    """Seed of the noise and of the failure points."""

    def __post_init__(self) -> None:
        if not 0 <= self.noise_sigma <= MAX_NOISE_SIGMA:  # NaN fails both comparisons
            raise ValueError(
                f"noise_sigma must be a finite number from 0 to {MAX_NOISE_SIGMA:g}, got {self.noise_sigma}"
            )
        bad = {r: f for r, f in self.slowdown.items() if not (math.isfinite(f) and f >= 1.0)}
        if bad:
            raise ValueError(f"slowdown factors must be finite numbers >= 1, got {bad}")
        late = [f for f in self.failures if not (f.step >= 0 and math.isfinite(f.restart_s) and f.restart_s >= 0)]
        if late:
            raise ValueError(f"a failure needs a step >= 0 and a finite restart time >= 0, got {late[0]}")

    def check_replicas(self, n_replicas: int) -> None:
        """ValueError naming a straggler or failure whose replica id the deployment does not have."""
        for r in [*self.slowdown, *(f.replica_id for f in self.failures)]:
            if not 0 <= r < n_replicas:
                raise ValueError(f"replica {r} does not exist: the plan has replicas 0..{n_replicas - 1}")


class SimulatedExecutor:
    """An :class:`~lorafleet.executor.Executor` whose hardware is the cost model."""

    def __init__(
        self,
        plan: DeploymentPlan,
        cost_model: CostModel,
        task_names: Sequence[str],
        options: SimulationOptions = SimulationOptions(),
    ) -> None:
        self.plan = plan
        self.cost_model = cost_model.spanning(r.config.pool for r in plan.replicas)
        self.task_names = tuple(task_names)
        self.options = options

    def _replica_busy(self, step_plan: StepPlan, rng: np.random.Generator) -> tuple[list[float], list[int]]:
        busy, failed = [], []
        failing = {f.replica_id: f for f in self.options.failures if f.step == step_plan.step}
        window = self.plan.policy.pipeline_window
        for replica, work in zip(self.plan.replicas, step_plan.work, strict=True):
            mbs = work.microbatches
            t = self.cost_model.replica_time(
                replica.config, [mb.shape for mb in mbs], [mb.task_ids for mb in mbs], window=window
            )
            noise = rng.lognormal(0.0, self.options.noise_sigma) if self.options.noise_sigma else 1.0
            t *= self.options.slowdown.get(replica.replica_id, 1.0) * noise
            if replica.replica_id in failing:
                # Work done before the crash is lost and redone after the restart.
                t += failing[replica.replica_id].restart_s + rng.uniform() * t
                failed.append(replica.replica_id)
            busy.append(float(t))
        return busy, failed

    def run_steps(self, step_plans: Sequence[StepPlan]) -> list[StepReport]:
        """The steps one after another (a window of them, as the executor protocol hands them over)."""
        return [self.run_step(p) for p in step_plans]

    def run_step(self, step_plan: StepPlan) -> StepReport:
        rng = np.random.default_rng(np.random.SeedSequence([self.options.seed, step_plan.step]))
        busy, failed = self._replica_busy(step_plan, rng)
        tokens, padding = step_plan.task_token_counts(self.task_names)
        return StepReport(
            step=step_plan.step,
            replica_busy_s=tuple(busy),
            makespan_s=max(busy, default=0.0),
            task_tokens=tokens,
            task_padding_tokens=padding,
            estimated_makespan_s=step_plan.estimated_makespan_s,
            dispatch_solve_s=step_plan.solve_s,
            failed_replicas=tuple(failed),
        )
