"""How one step is dispatched: the options of :func:`lorafleet.dispatch.dispatch_step`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lorafleet.errors import InputError, coerce_enum_fields
from lorafleet.solvers import SolverName

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
        coerce_enum_fields(self, OPTIONS_SOURCE, {"method": DispatchMethod, "solver": SolverName, "microbatch_mode": MicroBatchMode})
        if not self.time_limit_s > 0:
            raise InputError(OPTIONS_SOURCE, "time_limit_s", f"must be > 0 seconds, got {self.time_limit_s}")
        if not 0 <= self.gap_rel < 1:
            raise InputError(OPTIONS_SOURCE, "gap_rel", f"must be in [0, 1), got {self.gap_rel}")
        if self.n_buckets < 1:
            raise InputError(OPTIONS_SOURCE, "n_buckets", f"must be >= 1, got {self.n_buckets}")
        if self.bucket_alignment < 1:
            raise InputError(OPTIONS_SOURCE, "bucket_alignment", f"must be >= 1 token, got {self.bucket_alignment}")
