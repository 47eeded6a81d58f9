"""The cost model every stage consumes: stage, replica and step times, and max tokens M.

Its three sources (fitted from profiles, analytic from datasheets, measured by the
profiler) all produce this one object, so the planner, the dispatcher and the simulated
executor never know where the numbers came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import LayerTimeCoeffs, MicroBatchShape
from lorafleet.specs.model import ModelSpec

MS = 1e-3


@dataclass(frozen=True)
class CostModel:
    """Time (seconds) and memory (tokens) of every parallel config of one model on one GPU kind."""

    model: ModelSpec
    """The base model the figures are for."""
    layer_time: Mapping[int, LayerTimeCoeffs]
    """t(b, s) per TP degree, ms per transformer layer (LobRA Eq. 10)."""
    max_tokens_table: Mapping[ParallelConfig, int]
    """M per config: a micro-batch fits iff its tokens (padding included) <= M."""
    source: str = "unknown"
    """Where the figures came from: ``fitted:<profile>``, ``analytic:<gpu>``, ..."""
    step_overhead_s: Mapping[ParallelConfig, float] = field(default_factory=dict)
    """Per-step fixed time of a replica (adapter gradient all-reduce, optimizer step), seconds."""

    @property
    def configs(self) -> list[ParallelConfig]:
        """Configs with both a time model and a memory figure, sorted."""
        return sorted(c for c in self.max_tokens_table if c.tp in self.layer_time)

    def max_tokens(self, config: ParallelConfig) -> int:
        """M of ``config`` (0 when the model does not fit at all)."""
        return int(self.max_tokens_table.get(config, 0))

    def microbatch_time(self, config: ParallelConfig, b: np.ndarray | float, s: np.ndarray | float) -> np.ndarray | float:
        """Stage time of one padded micro-batch, fwd+bwd, seconds: t_tp(b, s) * L / pp."""
        per_layer = self.layer_time[config.tp](b, s)
        return per_layer * (self.model.n_layers / config.pp) * MS

    def packed_microbatch_time(self, config: ParallelConfig, seq_lens: Sequence[int]) -> float:
        """Stage time of one packed micro-batch, fwd+bwd, seconds."""
        return self.layer_time[config.tp].packed(seq_lens) * (self.model.n_layers / config.pp) * MS

    def shape_time(self, config: ParallelConfig, mb: MicroBatchShape) -> float:
        """Stage time of a micro-batch described by its shape (padded or packed)."""
        if mb.padded_len is None:
            return self.packed_microbatch_time(config, mb.seq_lens)
        return float(self.microbatch_time(config, mb.n_seqs, mb.padded_len))

    def step_overhead(self, config: ParallelConfig) -> float:
        """Per-step fixed seconds of one replica of ``config``."""
        return float(self.step_overhead_s.get(config, 0.0))

    def replica_time(self, config: ParallelConfig, microbatches: Sequence[MicroBatchShape]) -> float:
        """One replica's step time, seconds (LobRA Eq. 12 plus the step overhead)::

            T = Σ_k τ_k + (pp - 1) * max_k τ_k + overhead

        where τ_k is the stage time of micro-batch k: 1F1B pays every micro-batch once per
        stage in steady state and the largest one again in warm-up and cool-down.
        """
        if not microbatches:
            return 0.0
        times = [self.shape_time(config, mb) for mb in microbatches]
        return sum(times) + (config.pp - 1) * max(times) + self.step_overhead(config)
