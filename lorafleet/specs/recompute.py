"""Whether replicas may recompute activations: a choice of the workload, made by the planner."""

from __future__ import annotations

from enum import StrEnum


class RecomputePolicy(StrEnum):
    """Which parallel configs the planner may deploy, by activation recomputation.

    Full recomputation keeps one hidden state per block and token instead of every
    activation (10-20x less memory per token on Llama2), for about 40% more block time: it
    is how a config holds sequences far longer than its plain max tokens M.
    """

    AUTO = "auto"
    """Both variants of every config are candidates; the planner picks per config."""
    OFF = "off"
    """Never recompute (LobRA's 7B setup)."""
    ON = "on"
    """Every replica recomputes."""

    def allows(self, recompute: bool) -> bool:
        """Whether a config with (``True``) or without (``False``) recomputation may be deployed."""
        return self is RecomputePolicy.AUTO or recompute == (self is RecomputePolicy.ON)
