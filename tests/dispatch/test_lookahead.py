"""Look-ahead: the plan computed on the background thread is the plan a synchronous call gives."""

from __future__ import annotations

import dataclasses

import pytest

import lorafleet.dispatch.ilp as ilp_module
from lorafleet.dispatch import DispatchOptions, LookaheadDispatcher, dispatch_step
from lorafleet.errors import SolverFallbackWarning
from lorafleet.presets import LOBRA_7B_PLAN, lobra_7b_cost_model, lognormal_batch, make_plan
from lorafleet.solvers import SolveResult, SolverName, SolveStatus

COST_MODEL = lobra_7b_cost_model()
PLAN = make_plan(LOBRA_7B_PLAN)


def batch_for_step(step):
    return lognormal_batch(step, scale=0.5)


def without_timing(step_plan):
    return dataclasses.replace(step_plan, solve_s=0.0)


@pytest.mark.parametrize(
    "options", [DispatchOptions(microbatch_mode="padding"), DispatchOptions(microbatch_mode="packing", n_buckets=8)]
)
def test_lookahead_equals_synchronous(options):
    with LookaheadDispatcher(batch_for_step, PLAN, COST_MODEL, options) as ahead:
        ahead_plans = [ahead.plan_for(step) for step in range(4)]
        resumed = ahead.plan_for(9)  # a jump (resume) discards the step planned ahead
    synchronous = [dispatch_step(batch_for_step(step), PLAN, COST_MODEL, options) for step in (0, 1, 2, 3, 9)]
    assert [without_timing(p) for p in [*ahead_plans, resumed]] == [without_timing(p) for p in synchronous]
    assert [p.step for p in ahead_plans] == [0, 1, 2, 3]


def test_next_step_is_planned_while_the_current_one_runs():
    with LookaheadDispatcher(batch_for_step, PLAN, COST_MODEL) as ahead:
        ahead.plan_for(0)
        assert 1 in ahead._pending
        ahead._pending[1].result(timeout=30)  # finished without the caller asking
        assert ahead.plan_for(1).step == 1


def test_fallback_is_warned_on_the_callers_thread(monkeypatch):
    monkeypatch.setattr(
        ilp_module,
        "solve",
        lambda problem, solver, time_limit_s, gap_rel: SolveResult(SolveStatus.FAILED, None, 0.0, SolverName(solver)),
    )
    with LookaheadDispatcher(
        batch_for_step, PLAN, COST_MODEL, DispatchOptions(microbatch_mode="padding", method="exact")
    ) as ahead:
        with pytest.warns(SolverFallbackWarning):
            step_plan = ahead.plan_for(0)
    assert step_plan.method.endswith("->fast")


def test_errors_reach_the_caller():
    def broken(step):
        raise ValueError(f"no batch for step {step}")

    with LookaheadDispatcher(broken, PLAN, COST_MODEL) as ahead, pytest.raises(ValueError, match="step 0"):
        ahead.plan_for(0)
