"""Time of a micro-batch on one layer, one stage, and one replica's step.

Per transformer layer and TP degree, one micro-batch of ``b`` sequences padded to ``s``
tokens takes (LobRA, Appendix D, Eq. 10)::

    t(b, s) = (c1*b + c2)*s^2 + (c3*b + c4)*s + (c5*b + c6)            [ms]

The quadratic terms are attention, the linear ones every projection, the constants launch
and synchronisation overhead. A *packed* micro-batch of sequences s_1..s_n (S tokens,
attention kept inside each sequence) costs attention per sequence and projections per
token::

    t_pack(s_1..s_n) = c1*Σ s_i^2 + c2*max_i s_i^2 + (c3 + c4/S)*S + c5*n + c6

which equals t(b, s) when all n = b sequences have length s, except c4*s, which a padded
batch pays once per micro-batch and a packed one once per S tokens (one kernel row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

N_COEFFS = 6


@dataclass(frozen=True)
class LayerTimeCoeffs:
    """The six LobRA coefficients c1..c6 of one TP degree, in milliseconds per layer."""

    c: tuple[float, float, float, float, float, float]

    def __post_init__(self) -> None:
        if len(self.c) != N_COEFFS:
            raise ValueError(f"need {N_COEFFS} coefficients, got {len(self.c)}")

    def __call__(self, b: np.ndarray | float, s: np.ndarray | float) -> np.ndarray | float:
        """t(b, s) in ms (vectorised over numpy arrays; t(0, s) = 0: an empty fragment costs nothing)."""
        c1, c2, c3, c4, c5, c6 = self.c
        b = np.asarray(b, dtype=float)
        s = np.asarray(s, dtype=float)
        t = (c1 * b + c2) * s**2 + (c3 * b + c4) * s + (c5 * b + c6)
        t = np.where(b > 0, t, 0.0)
        return float(t) if t.ndim == 0 else t

    def packed(self, seq_lens: Sequence[int] | np.ndarray) -> float:
        """t_pack of one packed micro-batch, in ms (see the module docstring)."""
        lens = np.asarray(seq_lens, dtype=float)
        if lens.size == 0:
            return 0.0
        c1, c2, c3, c4, c5, c6 = self.c
        return float(c1 * (lens**2).sum() + c2 * lens.max() ** 2 + c3 * lens.sum() + c4 + c5 * lens.size + c6)

    @staticmethod
    def design_row(b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Feature matrix X with t = X @ c: columns b s^2, s^2, b s, s, b, 1 (for fitting)."""
        b = np.asarray(b, dtype=float)
        s = np.asarray(s, dtype=float)
        return np.stack([b * s**2, s**2, b * s, s, b, np.ones_like(s)], axis=-1)


@dataclass(frozen=True)
class MicroBatchShape:
    """What the cost model needs of a micro-batch: its sequences' lengths and how they are laid out."""

    seq_lens: tuple[int, ...]
    """Unpadded length of every sequence in the micro-batch."""
    padded_len: int | None = None
    """Bucket length every sequence is padded to; ``None`` for a packed micro-batch."""

    @property
    def n_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def tokens(self) -> int:
        """Tokens the micro-batch occupies (padding included): what must fit in max tokens M."""
        if self.padded_len is None:
            return int(sum(self.seq_lens))
        return self.padded_len * len(self.seq_lens)
