"""What a sliding window saves of a block's attention: the key positions its queries meet.

Causal attention over a sequence of s tokens has query i meet keys 0..i, so its work is proportional to
``K(s) = Σ_{i<s} (i + 1) = s(s+1)/2`` key positions. A layer with a sliding window of w tokens (query i
meets keys i-w+1..i, the executor's ``attention._window_mask``, FlashAttention's left window w - 1) meets::

    K_w(s) = Σ_{i<s} min(i + 1, w) = K(s)                      for s <= w
                                   = w(w+1)/2 + (s - w) w      for s >  w

LobRA's attention term prices a sequence as c1 s^2 (its K(s), up to the diagonal). A model whose blocks
are a share f windowed (Mistral and Phi-3: every block, Gemma 2: one in two, Gemma 3: five in six) has a
block's mean attention ``(1 - f) K(s) + f K_w(s)``, so its term is ``c1 s^2 ρ(s)`` with the ratio::

    ρ(s) = (1 - f) + f K_w(s) / K(s)        (1 for s <= w: a window longer than the sequence saves nothing)

For a stage of L/pp blocks the share f is the busiest stage's: the one holding the most full-attention
blocks (the executor splits a model into pp equal runs of consecutive blocks). The memory model needs no
window: FlashAttention keeps no s x s scores, so a token's saved activations do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lorafleet.specs.model import ModelSpec


@dataclass(frozen=True)
class AttentionSpan:
    """The sliding window of a stage's windowed blocks and their share of its blocks."""

    window: int
    """w: the keys a query of a windowed block meets, itself included."""
    windowed_share: float
    """f: the share of the stage's blocks that have the window, in (0, 1]."""

    def __post_init__(self) -> None:
        if self.window < 1 or not 0 < self.windowed_share <= 1:
            raise ValueError(f"a sliding window needs w >= 1 and a share in (0, 1], got {self}")

    def ratio(self, lengths: np.ndarray) -> np.ndarray:
        """ρ(s) of every length (module docstring): the block's attention work over causal attention's."""
        s = np.asarray(lengths, dtype=float)
        w = float(self.window)
        full = s * (s + 1) / 2
        windowed = np.where(s <= w, full, w * (w + 1) / 2 + (s - w) * w)
        return (1 - self.windowed_share) + self.windowed_share * windowed / np.maximum(full, 1.0)


def stage_span(model: ModelSpec, pp: int) -> AttentionSpan | None:
    """The span of ``model``'s busiest stage of ``pp`` (the fewest windowed blocks), or None when it has no
    windowed block (every block global: LobRA's c1 s^2 as it is)."""
    windowed = model.windowed_layers
    if model.sliding_window == 0 or not any(windowed):
        return None
    per_stage = len(windowed) // pp
    least = min(sum(windowed[k * per_stage : (k + 1) * per_stage]) for k in range(pp))
    if least == 0:
        return None
    return AttentionSpan(model.sliding_window, least / per_stage)
