"""How a deployment's steps are dispatched: the policy a plan is judged under and run with.

- :class:`DispatchOptions`: one step's bucketing, balance and micro-batch options
  (:func:`lorafleet.dispatch.dispatch_step`).
- :class:`Recalibration`: how measured replica times correct the cost model between steps
  (:mod:`lorafleet.dispatch.recalibration`).
- :class:`DispatchPolicy`: both, plus LobRA's static buckets for its baseline and the pipeline
  window (how many steps a pipelined replica streams before it drains,
  :mod:`lorafleet.costmodel.schedule`). A
  :class:`~lorafleet.plans.DeploymentPlan` records the policy it was judged under, and
  ``simulate``, ``dispatch`` and ``train`` run it (DESIGN: "A plan is a contract").

Plain data below the plans and the dispatcher, so both can hold it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from lorafleet.errors import InputError, coerce_enum_fields
from lorafleet.specs.solver import SolverName

OPTIONS_SOURCE = "<dispatch options>"


class DispatchMethod(StrEnum):
    FAST = "fast"
    """Greedy water-filling over buckets, then local search (``balance.balance_fast``); milliseconds."""
    EXACT = "exact"
    """The aggregated (config, bucket) MILP (``ilp.py``), bounded by the fast result; falls back to it."""
    LENGTH = "length"
    """LobRA's length-based "GROUP" baseline: each bucket only on its tightest config."""


class MicroBatchMode(StrEnum):
    PADDING = "padding"
    """Every row padded to its bucket's boundary (LobRA)."""
    PACKING = "packing"
    """Sequences concatenated up to M tokens, boundaries kept (varlen attention)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchOptions:
    """Options of one step's dispatch; strings are accepted for the enums and converted."""

    method: DispatchMethod = DispatchMethod.FAST
    """How sequences are balanced over configs: fast (default), exact MILP, or the length baseline."""
    solver: SolverName = SolverName.CBC
    """MILP back end of the exact method."""
    time_limit_s: float = 10.0
    """Wall-clock limit of one exact solve, seconds; on timeout without a solution the fast result is used."""
    gap_rel: float = 1e-4
    """Relative optimality gap at which the exact solve may stop."""
    n_buckets: int = 16
    """R: at most this many padding buckets per step (raised to the number of memory classes present)."""
    bucket_alignment: int = 16
    """Candidate bucket boundaries are lengths rounded up to a multiple of this (tokens)."""
    microbatch_mode: MicroBatchMode = MicroBatchMode.PADDING
    """Pad rows to the bucket boundary, or pack sequences up to M tokens."""
    choose_buckets_by_makespan: bool = False
    """Try every bucket count 1..R and keep the one with the least estimated makespan (not least padding)."""

    def __post_init__(self) -> None:
        coerce_enum_fields(
            self, OPTIONS_SOURCE, {"method": DispatchMethod, "solver": SolverName, "microbatch_mode": MicroBatchMode}
        )
        if not self.time_limit_s > 0:
            raise InputError(OPTIONS_SOURCE, "time_limit_s", f"must be > 0 seconds, got {self.time_limit_s}")
        if not 0 <= self.gap_rel < 1:
            raise InputError(OPTIONS_SOURCE, "gap_rel", f"must be in [0, 1), got {self.gap_rel}")
        if self.n_buckets < 1:
            raise InputError(OPTIONS_SOURCE, "n_buckets", f"must be >= 1, got {self.n_buckets}")
        if self.bucket_alignment < 1:
            raise InputError(OPTIONS_SOURCE, "bucket_alignment", f"must be >= 1 token, got {self.bucket_alignment}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Recalibration:
    """Per-replica correction of the cost model from measured busy times (``dispatch.recalibration``)."""

    enabled: bool = True
    """Correct the dispatcher's cost model from each step's measured replica times."""
    smoothing: float = 0.5
    """beta of the debiased exponential average of log(measured / predicted): the weight of the past."""
    bound: float = 4.0
    """A replica's correction stays within [1 / bound, bound] times the fleet's median correction."""

    def __post_init__(self) -> None:
        if not 0 <= self.smoothing < 1:
            raise InputError(OPTIONS_SOURCE, "recalibration.smoothing", f"must be in [0, 1), got {self.smoothing}")
        if not (math.isfinite(self.bound) and self.bound >= 1):
            raise InputError(OPTIONS_SOURCE, "recalibration.bound", f"must be a finite number >= 1, got {self.bound}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchPolicy:
    """How a deployment's sequences are bucketed, balanced and cut into micro-batches, step after step."""

    options: DispatchOptions = field(default_factory=DispatchOptions)
    """The dispatcher's options: balance method, padding or packing, dynamic bucket count."""
    static_boundaries: tuple[int, ...] = ()
    """Fixed padding buckets (LobRA's Task-Fused baseline); empty: the dispatcher's per-step DP."""
    recalibration: Recalibration = field(default_factory=Recalibration)
    """Online correction of the cost model from what the run measures."""
    pipeline_window: int = 8
    """Steps a pipelined replica streams before it drains; 1 = 1F1B flushed every step (LobRA's).
    The cost model a plan is priced by carries the same window (``CostModel.pipeline_window``)."""

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_window, bool) or not isinstance(self.pipeline_window, int):
            raise InputError(
                OPTIONS_SOURCE, "pipeline_window", f"must be a whole number of steps, got {self.pipeline_window!r}"
            )
        if self.pipeline_window < 1:
            raise InputError(OPTIONS_SOURCE, "pipeline_window", f"must be >= 1 step, got {self.pipeline_window}")
        bounds = self.static_boundaries
        if any(b < 1 for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise InputError(
                OPTIONS_SOURCE, "static_boundaries", f"must be positive and strictly increasing, got {list(bounds)}"
            )

    def describe(self) -> str:
        """``packing, R=16, alignment 16, fast, recalibrated, pipeline window 8`` (what a command prints it runs)."""
        o = self.options
        buckets = f"static buckets {list(self.static_boundaries)}" if self.static_boundaries else f"R={o.n_buckets}"
        extra = ", by makespan" if o.choose_buckets_by_makespan else ""
        cal = "recalibrated" if self.recalibration.enabled else "not recalibrated"
        return (
            f"{o.microbatch_mode.value}, {buckets}{extra}, alignment {o.bucket_alignment}, {o.method.value}, {cal}, "
            f"pipeline window {self.pipeline_window}"
        )

    def to_json(self) -> dict[str, Any]:
        o, r = self.options, self.recalibration
        return {
            "microbatch_mode": o.microbatch_mode.value,
            "n_buckets": o.n_buckets,
            "bucket_alignment": o.bucket_alignment,
            "method": o.method.value,
            "solver": o.solver.value,
            "time_limit_s": o.time_limit_s,
            "gap_rel": o.gap_rel,
            "choose_buckets_by_makespan": o.choose_buckets_by_makespan,
            "static_boundaries": list(self.static_boundaries),
            "recalibration": {"enabled": r.enabled, "smoothing": r.smoothing, "bound": r.bound},
            "pipeline_window": self.pipeline_window,
        }

    @classmethod
    def from_json(cls, data: Any, source: str, where: str = "policy") -> DispatchPolicy:
        """The policy of a JSON object (a plan's ``policy``); an InputError names ``source`` and the field.

        A policy without ``pipeline_window`` was written before the window existed, when every
        pipelined step was 1F1B flushed (the plan was judged under that): it reads as 1, not as
        today's default.
        """
        if not isinstance(data, dict):
            raise InputError(source, where, f"expected an object, got {type(data).__name__}")
        names = {
            "microbatch_mode",
            "n_buckets",
            "bucket_alignment",
            "method",
            "solver",
            "time_limit_s",
            "gap_rel",
            "choose_buckets_by_makespan",
        }
        unknown = sorted(set(data) - names - {"static_boundaries", "recalibration", "pipeline_window"})
        if unknown:
            raise InputError(source, f"{where}.{unknown[0]}", "unknown field")
        cal = data.get("recalibration", {})
        if not isinstance(cal, dict) or set(cal) - {"enabled", "smoothing", "bound"}:
            raise InputError(source, f"{where}.recalibration", "expected {enabled, smoothing, bound}")
        try:
            return cls(
                options=DispatchOptions(**{k: v for k, v in data.items() if k in names}),
                static_boundaries=tuple(int(b) for b in data.get("static_boundaries", ())),
                recalibration=Recalibration(**cal),
                pipeline_window=data.get("pipeline_window", 1),
            )
        except InputError as err:
            raise InputError(source, f"{where}.{err.field}", err.msg) from None
        except (TypeError, ValueError) as err:
            raise InputError(source, where, str(err)) from None
