"""What a micro-batch's size does to its time per token beyond the LobRA form: the knee, and the size M that it sets.

LobRA's stage time is affine in a micro-batch's tokens S (with the attention terms of its sequences), so a token
costs the same in any micro-batch and a bigger micro-batch only amortises the fixed cost c6: the largest M that
fits in memory is always the fastest. On this repository's CPU it is not (``benchmarks/bench_microbatch.py``):
past a knee of K tokens, where a micro-batch's activations, logits and their gradients grow to GBs, every
further token costs ``1 + ρ`` times its affine price. The stage time becomes::

    τ'(mb) = τ(mb) + ρ · c3 · max(0, S − K)            [ms]

with c3 the stage's per-token coefficient (``LayerTimeCoeffs.c[2]``: projections, head, transfers). Over full
micro-batches of m tokens (sequences of one length, so the attention terms are per token too) a token costs
``c_token + c6 / m`` below the knee, and above it::

    τ'(m) / m = c_token + ρ · c3 + (c6 − ρ · c3 · K) / m

which rises with m exactly when ``ρ · c3 · K > c6``: then K is the size where a token costs least, and M, the
tokens a plan lets a micro-batch hold, is the memory limit capped there (:meth:`MicroBatchKnee.efficient_tokens`);
otherwise the fixed cost still outweighs the penalty and M stays the memory limit. A micro-batch of at most K
tokens is priced exactly as before, so a plan whose M is at most K keeps the LobRA form its linear formulations
need.

The knee is a working-set size, so it is given in bytes (``GPUSpec.microbatch_knee_gib``, by the memory model's
bytes a token) and each config's K is those bytes over its bytes a token (``build.analytic_cost_model``): ~2,040
tokens of SmolLM2-135M, ~5,600 under activation recomputation, ~117K of tiny-llama. Only the ``cpu`` preset has a
knee; the GPU presets have none, and their models and plans are what they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel.time_model import LayerTimeCoeffs


@dataclass(frozen=True)
class MicroBatchKnee:
    """The size past which a micro-batch's tokens cost more (module docstring)."""

    tokens: int
    """K: the tokens of a micro-batch that the LobRA form alone prices."""
    penalty: float
    """ρ: the extra share of its per-token cost that every token past K pays."""

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.penalty < 0:
            raise ValueError(f"a knee is at >= 1 token with a penalty >= 0, got {self.tokens}, {self.penalty}")

    def excess_ms(self, stage: LayerTimeCoeffs, tokens: np.ndarray) -> np.ndarray:
        """``ρ · c3 · max(0, S − K)`` of micro-batches of ``tokens`` tokens, ms, on a stage of coefficients
        ``stage``."""
        return self.penalty * stage.c[2] * np.maximum(np.asarray(tokens, dtype=float) - self.tokens, 0.0)

    def efficient_tokens(self, stage: LayerTimeCoeffs, memory_tokens: int) -> int:
        """The planner's M on a stage of coefficients ``stage`` whose memory holds ``memory_tokens``: K where a
        token costs least there (``ρ · c3 · K > c6``), else the memory limit; never above the memory limit."""
        if self.penalty * stage.c[2] * self.tokens > stage.c[5]:
            return min(self.tokens, memory_tokens)
        return memory_tokens
