"""DispatchPolicy's pipeline window: default, JSON round trip, a plan written before it, invalid values."""

from __future__ import annotations

import pytest

from lorafleet.errors import InputError
from lorafleet.specs.dispatch import DispatchOptions, DispatchPolicy, MicroBatchMode


def test_the_window_round_trips_and_is_described():
    policy = DispatchPolicy(options=DispatchOptions(microbatch_mode=MicroBatchMode.PACKING), pipeline_window=3)
    data = policy.to_json()
    assert data["pipeline_window"] == 3
    assert DispatchPolicy.from_json(data, "plan.json") == policy
    assert policy.describe().endswith(", pipeline window 3")
    assert DispatchPolicy().pipeline_window == 8
    assert DispatchPolicy.from_json(DispatchPolicy().to_json(), "plan.json") == DispatchPolicy()


def test_a_policy_without_the_key_was_judged_flushed_every_step():
    data = DispatchPolicy().to_json()
    del data["pipeline_window"]
    assert DispatchPolicy.from_json(data, "plan.json").pipeline_window == 1


@pytest.mark.parametrize("value", [0, -2, 2.5, "8", True])
def test_an_invalid_window_is_one_line_naming_the_field(value):
    data = DispatchPolicy().to_json() | {"pipeline_window": value}
    with pytest.raises(InputError) as err:
        DispatchPolicy.from_json(data, "plan.json")
    assert err.value.path == "plan.json" and err.value.field == "policy.pipeline_window"
    assert "\n" not in str(err.value) and ("must be >= 1 step" in err.value.msg or "whole number" in err.value.msg)
    with pytest.raises(InputError, match="pipeline_window: must be"):
        DispatchPolicy(pipeline_window=value)
