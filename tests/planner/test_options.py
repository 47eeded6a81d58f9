"""PlannerOptions validate themselves and name the field."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet.dispatch import DispatchOptions, DispatchPolicy, MicroBatchMode
from lorafleet.errors import InputError
from lorafleet.planner import PlannerMode, PlannerOptions
from lorafleet.solvers import SolverName


def test_strings_become_enums():
    options = PlannerOptions(
        mode="exhaustive", solver="highs", policy=DispatchPolicy(options=DispatchOptions(microbatch_mode="padding"))
    )
    assert options.mode is PlannerMode.EXHAUSTIVE and options.solver is SolverName.HIGHS
    assert options.policy.options.microbatch_mode is MicroBatchMode.PADDING


@pytest.mark.parametrize(
    "field,value",
    [
        ("mode", "magic"),
        ("solver", "gurobi"),
        ("time_limit_s", 0),
        ("pool_size", 0),
        ("search_rounds", 0),
        ("min_survivors", 0),
        ("robust_top", 0),
        ("race_rung", 0),
        ("enumeration_limit", 0),
        ("gap_rel", 1.0),
        ("tie_rel", -0.1),
        ("lower_bound_threshold", 2.0),
        ("exact_top", -1),
        ("robust_samples", -1),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InputError, match=field):
        PlannerOptions(**{field: value})


@pytest.mark.parametrize("field,value", [("microbatch_mode", "zip"), ("n_buckets", 0), ("pipeline_window", 0)])
def test_bad_policy_values_name_the_field(field, value):
    """The policy the planner judges under is one object (``PlannerOptions.policy``), checked as it is built."""
    with pytest.raises(InputError, match=field):
        PlannerOptions(policy=DispatchPolicy().with_overrides({field: value}))


def test_frozen_and_keyword_only():
    options = PlannerOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.policy = DispatchPolicy()
    with pytest.raises(TypeError):
        PlannerOptions(PlannerMode.DECOMPOSED)
