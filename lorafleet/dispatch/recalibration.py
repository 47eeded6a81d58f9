"""Online recalibration: what a run measures corrects the cost model the dispatcher prices with.

For replica r, each step it ran with a prediction p_r > 0 from the *uncorrected* cost model
(``StepPlan.base_estimate``) and a measured busy time m_r, the ratio x = m_r / p_r enters a
debiased exponential average (as Adam's moments):

    a_n = beta * a_{n-1} + (1 - beta) * x_n,   a_0 = 0,   f_r = a_n / (1 - beta^n)

An average of the ratios, not of their logarithms: step times are skewed to the right (a
preempted core, a page fault), and the geometric mean of such noise sits below its mean,
which would price every replica a few percent fast (with 20-30% noise, 2-5%).

n counts the steps r was observed, so the first observation is taken whole and later ones
are smoothed with weight (1 - beta). The correction splits into the scale g_p of replica r's
pool p, the median of the observed f of p's replicas (the model's general error on that GPU
kind: a CPU is not the GPU it was fitted on, an H100's profile may be off where an A100's is
not), and each replica's bounded departure from it:

    c_r = g_p * clip(f_r / g_p, 1 / B, B)          (c_r = g_p for a replica not yet observed)

so one absurd measurement never prices a replica more than B times its pool's peers, while a
model that is off for a whole pool is corrected in full. A pool none of whose replicas has been
observed yet takes what an earlier deployment measured on it (``load_state_dict``, ``prior``),
else the fleet's scale g, the median of every observed f: a new replica on a pool starts from
what its siblings measured. With one pool, g_p = g.

The dispatcher of the following steps prices replica r's micro-batches at c_r times the model's
times (``load.config_classes``: replicas of one config whose factors agree within 5% stay one
class). A replica 2x slower than its peers gets twice their factor after its first report, so it is
given about half the work from the next dispatch on; iid noise of sigma moves f_r by about sigma *
sqrt((1 - beta) / (1 + beta)) in steady state.

Steps where a replica failed, or was given nothing, say nothing about its speed and are skipped,
and so are the first ``warmup_steps`` a process runs (a real executor's first step pays one-time
costs, allocations and lazy initialisation, unevenly across ranks: on CPU up to 3x the steady
step, which taken whole would mis-price replicas for several steps).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet.plans import DeploymentPlan, StepPlan, StepReport
from lorafleet.specs.dispatch import Recalibration


@dataclass(frozen=True)
class ReplicaCalibration:
    """What recalibration knows of one replica."""

    factor: float
    """c_r: the dispatcher multiplies this replica's modelled times by it."""
    observed: int
    """Steps that informed it."""


class Recalibrator:
    """Per-replica correction factors of the cost model, updated from step reports (see the module doc)."""

    def __init__(
        self,
        n_replicas: int,
        options: Recalibration = Recalibration(),
        warmup_steps: int = 0,
        pools: Sequence[str] | None = None,
        prior: Mapping[str, float] | None = None,
    ) -> None:
        """``warmup_steps``: reports ignored at first (1 for a real executor's fresh processes, 0 simulated);
        ``pools``: each replica's pool (default: one pool); ``prior``: a pool's scale measured before, by pool
        (a pool's replicas start from it until one of them is observed)."""
        if pools is not None and len(pools) != n_replicas:
            raise ValueError(f"{len(pools)} pools for {n_replicas} replicas")
        self.options = options
        self._average = [0.0] * n_replicas
        self._observed = [0] * n_replicas
        self._warmup = warmup_steps
        self._pools = tuple(pools) if pools is not None else ("",) * n_replicas
        self._prior = dict(prior or {})

    @classmethod
    def for_plan(
        cls, plan: DeploymentPlan, warmup_steps: int = 0, prior: Mapping[str, float] | None = None
    ) -> Recalibrator:
        """The recalibrator of ``plan``'s replicas, under its policy's recalibration options."""
        return cls(len(plan.replicas), plan.policy.recalibration, warmup_steps, [r.pool for r in plan.replicas], prior)

    def moved(self, plan: DeploymentPlan, kept: Sequence[int | None]) -> Recalibrator:
        """The recalibrator of ``plan``, a new deployment of this run (a live change's move): replica ``i`` keeps
        what replica ``kept[i]`` of this one measured (its average and observations); a new one (None) starts
        from its pool's scale g_p as measured here (carried as the pools' priors)."""
        new = Recalibrator.for_plan(plan, prior={**self._prior, **self.measured_pool_scales()})
        for i, k in enumerate(kept):
            if k is not None:
                new._average[i], new._observed[i] = self._average[k], self._observed[k]
        return new

    @property
    def factors(self) -> tuple[float, ...] | None:
        """c_r per replica, in plan order; None when recalibration is off (the dispatcher prices at 1)."""
        if not self.options.enabled:
            return None
        return self._corrections()

    @property
    def scale(self) -> float:
        """g: the median of the observed replicas' factors (1 before any observation)."""
        observed = [f for f in self._raw() if f is not None]
        return statistics.median(observed) if observed else 1.0

    def pool_scales(self) -> dict[str, float]:
        """g_p by pool: the median of its observed replicas' factors, else its prior, else g."""
        g = self.scale
        scales = {}
        raw = self._raw()
        for pool in dict.fromkeys(self._pools):
            observed = [f for f, p in zip(raw, self._pools, strict=True) if p == pool and f is not None]
            scales[pool] = statistics.median(observed) if observed else self._prior.get(pool, g)
        return scales

    def _raw(self) -> list[float | None]:
        """f_r, the debiased average of each replica's ratios; None if never observed."""
        beta = self.options.smoothing
        return [a / (1 - beta**n) if n else None for a, n in zip(self._average, self._observed, strict=True)]

    def _corrections(self) -> tuple[float, ...]:
        scales, bound = self.pool_scales(), self.options.bound
        return tuple(
            scales[p] * min(max((f if f is not None else scales[p]) / scales[p], 1 / bound), bound)
            for f, p in zip(self._raw(), self._pools, strict=True)
        )

    def skip_next(self, n: int) -> None:
        """Leave the next ``n`` reports out (a fresh process's first steps, whose one-time costs say
        nothing of its speed)."""
        self._warmup = max(self._warmup, n)

    def replicas(self) -> tuple[ReplicaCalibration, ...]:
        return tuple(
            ReplicaCalibration(factor=c, observed=n) for c, n in zip(self._corrections(), self._observed, strict=True)
        )

    def observe(self, step_plan: StepPlan, report: StepReport) -> None:
        """Fold one step's measured busy times into the factors."""
        if not self.options.enabled:
            return
        if self._warmup > 0:
            self._warmup -= 1
            return
        beta = self.options.smoothing
        failed = set(report.failed_replicas)
        for r, (work, measured) in enumerate(zip(step_plan.work, report.replica_busy_s, strict=True)):
            predicted = step_plan.base_estimate(r)
            if work.replica_id in failed or not work.microbatches or not (predicted > 0 and measured > 0):
                continue
            if not (math.isfinite(predicted) and math.isfinite(measured)):
                continue
            self._average[r] = beta * self._average[r] + (1 - beta) * measured / predicted
            self._observed[r] += 1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, so a resumed run dispatches as the uninterrupted one would: each replica's
        average, and each pool's scale (what a re-planned deployment's replicas start from)."""
        return {
            "average": list(self._average),
            "observed": list(self._observed),
            "pools": list(self._pools),
            "pool_scales": self.measured_pool_scales(),
        }

    def measured_pool_scales(self) -> dict[str, float]:
        """g_p of the pools something was measured on (observed here, or before: a prior)."""
        raw = self._raw()
        measured = {p for f, p in zip(raw, self._pools, strict=True) if f is not None} | set(self._prior)
        return {p: g for p, g in self.pool_scales().items() if p in measured}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        average, observed = state.get("average", []), state.get("observed", [])
        pools = state.get("pools", list(self._pools))  # a checkpoint from before pools: one pool
        self._prior.update({str(p): float(g) for p, g in state.get("pool_scales", {}).items()})
        if (
            len(average) != len(self._average)
            or len(observed) != len(self._observed)
            or list(pools) != list(self._pools)
        ):
            return  # another deployment (re-planned): its replicas start from their pools' scales
        self._average = [float(a) for a in average]
        self._observed = [int(n) for n in observed]


def summarize_factors(factors: Sequence[ReplicaCalibration]) -> str:
    """``replica 0 x1.02 (12 steps), replica 1 x2.01 (12 steps)``: the run's last corrections."""
    return ", ".join(f"replica {r} x{c.factor:.2f} ({c.observed} steps)" for r, c in enumerate(factors))
