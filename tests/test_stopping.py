"""The early-stopping rule (``lorafleet.stopping``): Together's semantics, one implementation."""

from __future__ import annotations

import math

import pytest

from lorafleet.specs.evaluation import EarlyStoppingSpec
from lorafleet.stopping import Stopping


def _run(losses, spec):
    state, seen = Stopping(), []
    for step, loss in enumerate(losses, start=1):
        state = state.observe(loss, step * 10, spec)
        seen.append(state)
        if state.stopped:
            break
    return state, seen


def test_stops_patience_evaluations_after_the_best():
    state, seen = _run([3.0, 2.0, 1.5, 1.6, 1.55, 1.7, 1.4], EarlyStoppingSpec(patience=3, warmup_evals=1))
    assert state.stopped and state.evaluations == 6  # the best at 3, then 4, 5, 6 fail
    assert (state.best_loss, state.best_step) == (1.5, 30)
    assert [s.improved for s in seen] == [True, True, True, False, False, False]


def test_warmup_evaluations_never_count_but_set_the_best():
    spec = EarlyStoppingSpec(patience=1, warmup_evals=3)
    state, _ = _run([2.0, 2.5, 2.6, 2.7], spec)
    assert state.stopped and state.evaluations == 4 and state.best_loss == 2.0


def test_min_delta_an_improvement_smaller_is_no_new_best():
    state, _ = _run([2.0, 1.95, 1.92, 1.5], EarlyStoppingSpec(patience=2, min_delta=0.1, warmup_evals=0))
    assert state.stopped and state.evaluations == 3 and state.best_step == 10


def test_a_nan_never_improves_and_without_a_spec_nothing_stops():
    state, _ = _run([2.0, math.nan, 1.0, 3.0, 3.0, 3.0, 3.0], None)
    assert not state.stopped and (state.best_loss, state.best_step) == (1.0, 30)
    with pytest.raises(ValueError):
        _run([1.0, 2.0], EarlyStoppingSpec(patience=1, warmup_evals=0))[0].observe(1.0, 99, None)


def test_round_trips_through_json():
    state, _ = _run([3.0, 2.0, 2.5], EarlyStoppingSpec())
    assert Stopping.from_json(state.to_json()) == state
    assert Stopping.from_json(Stopping().to_json()) == Stopping()
