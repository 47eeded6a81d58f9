"""Early stopping: the one rule, for training (``train``) and its what-ifs (``simulate``).

A task's evaluations come in order, ``k = 1, 2, ...``, each a mean token loss ``L_k``. With ``best_0 = +inf``,

    improved_k = L_k < best_{k-1} - min_delta          (a NaN never improves)
    best_k     = L_k if improved_k else best_{k-1}
    bad_k      = 0 if improved_k else (bad_{k-1} + 1 if k > warmup_evals else 0)
    stop_k     = bad_k >= patience

Together's fine-tuning API's semantics (``early_stopping_patience``, ``early_stopping_min_delta``,
``early_stopping_warmup_evals``): the first ``warmup_evals`` evaluations never count against the task, but they set
the best. The best adapter is the one of the last improving evaluation (Keras's ``restore_best_weights`` with the
same ``min_delta``): a later loss lower by less than ``min_delta`` is no new best. So a task stops ``patience``
evaluations after its best, and a task that trains on never stops. Without early stopping (``spec`` None) the same
rule keeps the best with ``min_delta = 0`` and never stops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lorafleet.specs.evaluation import EarlyStoppingSpec


@dataclass(frozen=True)
class Stopping:
    """One task's early-stopping state after its evaluations so far (what a checkpoint records)."""

    evaluations: int = 0
    best_loss: float = math.inf
    best_step: int | None = None
    """The global step after which the best evaluation ran (None before the first that improved)."""
    bad: int = 0
    """Evaluations in a row since the best that did not improve, counted after the warm-up."""
    stopped: bool = False
    improved: bool = False
    """Whether the last evaluation was the new best."""

    def observe(self, loss: float, step: int, spec: EarlyStoppingSpec | None) -> Stopping:
        """The state after an evaluation of loss ``loss`` after global step ``step`` (module doc)."""
        if self.stopped:
            raise ValueError("a stopped task is evaluated no more")
        k = self.evaluations + 1
        min_delta = spec.min_delta if spec is not None else 0.0
        improved = loss < self.best_loss - min_delta  # False for a NaN
        if improved:
            return Stopping(k, loss, step, 0, False, True)
        warm = spec is not None and k > spec.warmup_evals
        bad = self.bad + 1 if warm else 0
        stopped = spec is not None and bad >= spec.patience
        return replace(self, evaluations=k, bad=bad, stopped=stopped, improved=False)

    def to_json(self) -> dict:
        return {
            "evaluations": self.evaluations,
            "best_loss": None if math.isinf(self.best_loss) else self.best_loss,
            "best_step": self.best_step,
            "bad": self.bad,
            "stopped": self.stopped,
            "improved": self.improved,
        }

    @classmethod
    def from_json(cls, raw: dict) -> Stopping:
        best = raw.get("best_loss")
        return cls(int(raw["evaluations"]), math.inf if best is None else float(best), raw.get("best_step"),
                   int(raw["bad"]), bool(raw["stopped"]), bool(raw["improved"]))  # fmt: skip
