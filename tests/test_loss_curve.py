"""A task's eval loss as a curve of its tokens (``lorafleet.loss_curve``, ``specs.loss_curve``), and the forward-only
price of an evaluation's micro-batches (``CostModel.forward_time``)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from lorafleet.costmodel import ParallelConfig
from lorafleet.costmodel.time_model import FORWARD_SHARE, MicroBatchShape, features_of
from lorafleet.loss_curve import curve_loss, fit_curve
from lorafleet.presets import lobra_7b_cost_model
from lorafleet.specs.evaluation import EvalSpec
from lorafleet.specs.loss_curve import LossCurveSpec

OVERFITS = LossCurveSpec(l_inf=1.2, a=0.8, alpha=0.5, rise=0.02, rise_after=30)


def test_the_curve_is_its_formula_in_millions_of_tokens():
    n = np.array([1.0, 4.0, 30.0, 50.0])
    expected = 1.2 + 0.8 * n**-0.5 + 0.02 * np.maximum(0, n - 30)
    assert curve_loss(OVERFITS, n * 1e6) == pytest.approx(expected, rel=1e-12)
    assert curve_loss(OVERFITS, 1e6) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="tokens > 0"):
        curve_loss(OVERFITS, 0)


def test_a_steep_enough_rise_puts_the_minimum_at_rise_after():
    """rise > alpha a rise_after^(-alpha-1) (here 0.8 * 0.5 / 30^1.5 = 0.0024): the lowest loss is at rise_after."""
    tokens = np.linspace(1e6, 60e6, 600)
    assert tokens[np.argmin(curve_loss(OVERFITS, tokens))] == pytest.approx(30e6, rel=0.01)
    falls = OVERFITS.model_copy(update={"rise": 0.0})
    assert np.all(np.diff(curve_loss(falls, tokens)) < 0)  # without a rise it falls for ever


@pytest.mark.parametrize("curve", [OVERFITS, LossCurveSpec(l_inf=0.9, a=1.5, alpha=0.3)])
def test_fit_recovers_the_parameters(curve):
    tokens = np.linspace(1e6, 60e6, 40)
    fitted = fit_curve(tokens, curve_loss(curve, tokens))
    assert (fitted.l_inf, fitted.a, fitted.alpha) == pytest.approx((curve.l_inf, curve.a, curve.alpha), rel=1e-4)
    assert fitted.rise == pytest.approx(curve.rise, rel=0.05, abs=1e-9)
    low = tokens[np.argmin(curve_loss(curve, tokens))] / 1e6
    assert fitted.rise_after == (pytest.approx(low) if curve.rise else 0.0)


def test_fit_needs_three_points_to_the_lowest_and_finite_ones():
    with pytest.raises(ValueError, match="2 points up to the lowest"):
        fit_curve([1e6, 2e6, 3e6], [2.0, 1.0, 1.5])
    with pytest.raises(ValueError, match="finite"):
        fit_curve([1e6, 2e6, 3e6], [2.0, float("nan"), 1.5])
    with pytest.raises(ValueError, match="3 token counts for 2"):
        fit_curve([1e6, 2e6, 3e6], [2.0, 1.0])


def test_the_curve_is_a_tasks_eval_curve_and_bad_values_are_refused():
    spec = EvalSpec.model_validate({"every_steps": 10, "curve": {"l_inf": 1.0, "a": 0.5}})
    assert spec.curve == LossCurveSpec(l_inf=1.0, a=0.5, alpha=0.5, rise=0.0, rise_after=0.0)
    assert EvalSpec().curve is None
    for bad in ({"l_inf": -1, "a": 0.5}, {"l_inf": 1, "a": 0.5, "alpha": 0}, {"l_inf": 1, "a": 0.5, "rise": -1}):
        with pytest.raises(ValidationError):
            EvalSpec.model_validate({"curve": bad})


def test_forward_time_is_each_terms_forward_share_with_one_fill_and_drain():
    model = lobra_7b_cost_model()
    mbs = [MicroBatchShape.packed([300, 800]), MicroBatchShape.packed([2000])]
    for config in (ParallelConfig(1, 1), ParallelConfig(1, 2), ParallelConfig(2, 1, recompute=True)):
        plain = model.stage_coeffs(config.with_recompute(False))
        tau = np.array([sum(c * s * f for c, s, f in zip(plain.c, FORWARD_SHARE, row)) for row in features_of(mbs)])
        expected = (tau.sum() + (config.pp - 1) * tau.max()) / 1e3
        assert model.forward_time(config, mbs) == pytest.approx(expected, rel=1e-12)
        assert model.forward_time(config, mbs) < 0.5 * model.replica_time(config, mbs)
    assert model.forward_time(ParallelConfig(1, 1), []) == 0.0
