"""A task's evaluation-loss curve for what-ifs (a task's ``eval.curve``): the parameters, validated.

Example (under a task's ``eval``; ``lorafleet simulate`` reads it, ``train`` measures its losses instead)::

    eval:
      every_steps: 50
      curve: {l_inf: 1.2, a: 0.8, alpha: 0.5, rise: 0.02, rise_after: 30}

The model, with ``n`` the task's trained real tokens in millions (``lorafleet.loss_curve``)::

    L(n) = l_inf + a * n^-alpha + rise * max(0, n - rise_after)

a power law falling to its plateau ``l_inf``, and from ``rise_after`` million tokens on an overfitting rise of
``rise`` a million tokens.
"""

from __future__ import annotations

from pydantic import Field

from lorafleet.specs._base import Float, Spec


class LossCurveSpec(Spec):
    """The parameters of ``L(n) = l_inf + a n^-alpha + rise max(0, n - rise_after)``, n in millions of tokens."""

    l_inf: Float = Field(ge=0)
    """The plateau: the loss the power law falls to."""
    a: Float = Field(ge=0)
    """How far above the plateau the loss is after one million tokens (without the rise)."""
    alpha: Float = Field(0.5, gt=0, le=10)
    """The power law's exponent: how fast the loss falls to its plateau."""
    rise: Float = Field(0.0, ge=0)
    """Overfitting: the loss rises by this much a million tokens past ``rise_after`` (0: never)."""
    rise_after: Float = Field(0.0, ge=0)
    """Millions of trained tokens from which the loss rises by ``rise``."""
