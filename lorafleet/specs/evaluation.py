"""A task's evaluation on held-out rows and its early stopping (a task's ``eval`` and ``early_stopping`` keys).

Example (under a task, or under the workload's ``defaults`` like every other task key)::

    eval:
      split: 0.05          # or data: {path: held_out.jsonl, format: messages}
      every_steps: 50      # the task's own steps (batches it took), and its last one
      max_rows: 512
    early_stopping: {patience: 3, min_delta: 0.0, warmup_evals: 1}

**When.** A task is evaluated after every ``every_steps`` of *its own* steps (the global batches it took part in:
a task with a ``share`` skips global steps, and its evaluations stay ``every_steps`` updates apart), after each rung
boundary of its sweep (a member of one with successive halving: ``specs.sweep``), and after its last one, so the
adapter it ends with has an evaluation too (``lorafleet.eval_schedule``: one function of the spec and the step).
Counting the task's steps, not tokens or epochs, is the documented choice: its updates are what change its adapter,
and a task's steps are known before it runs, so the planner and ``simulate`` count its evaluations exactly.

**Stopping** (Together's fine-tuning API's semantics): evaluation ``k`` (1-based) improves when its loss is below
the best so far by more than ``min_delta``; the first ``warmup_evals`` evaluations never stop the task; after them,
the task stops once ``patience`` evaluations in a row have not improved (``lorafleet.stopping.Stopping``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from lorafleet.specs._base import Float, Int, Spec
from lorafleet.specs.data import DataSpec
from lorafleet.specs.loss_curve import LossCurveSpec

DEFAULT_SPLIT = 0.05
"""The held-out fraction of a task's rows when its ``eval`` names neither ``split`` nor ``data``."""


class EvalSpec(Spec):
    """Where a task's held-out rows come from, and how often and how much of them it is evaluated on."""

    split: Float | None = Field(None, gt=0, le=0.5)
    """The fraction of the task's rows held out of training for evaluation, in (0, 0.5]: chosen by a hash of each
    row's tokens seeded by the task's name (``runtime.eval_split``), so the same rows whatever their order, every
    copy of a row on the same side, and none in both. Default 0.05 unless ``data`` is given."""
    data: DataSpec | None = None
    """A held-out file (or saved dataset) instead of a split: the task trains on all of its own ``data``."""
    every_steps: Int = Field(50, ge=1, le=1_000_000)
    """Evaluate after every this many of the task's own steps (module doc), and after its last."""
    max_rows: Int = Field(512, ge=1, le=1_000_000)
    """At most this many held-out rows an evaluation (the first in the split's hash order): bounds its cost."""
    curve: LossCurveSpec | None = None
    """What-ifs only: the task's evaluation loss as a curve of its trained tokens (``specs.loss_curve``), which
    ``simulate`` evaluates and stops the task by; ``train`` measures its losses and ignores it. None: no modelled
    loss, so the task's evaluations are priced but it never stops early."""

    @model_validator(mode="before")
    @classmethod
    def _split_or_data(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        if raw.get("split") is not None and raw.get("data") is not None:
            raise ValueError(
                "set split or data, not both (under a default split, a task's own eval data needs split: null)"
            )
        if raw.get("data") is None and raw.get("split") is None:
            return {**raw, "split": DEFAULT_SPLIT}
        return raw


class EarlyStoppingSpec(Spec):
    """When a task stops before its steps because its evaluation loss stopped improving (module doc)."""

    patience: Int = Field(3, ge=1, le=1_000_000)
    """Evaluations in a row without an improvement of more than ``min_delta`` that stop the task."""
    min_delta: Float = Field(0.0, ge=0)
    """How much lower than the best so far an evaluation's loss must be to count as an improvement."""
    warmup_evals: Int = Field(1, ge=0, le=1_000_000)
    """Evaluations before any may stop the task (they still set the best)."""
