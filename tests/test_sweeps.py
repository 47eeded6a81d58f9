"""A sweep's rules once it runs (``lorafleet.sweeps``): a rung keeps the best ``max(1, floor(n / eta))`` by best eval
loss so far, ties to the earlier member, a NaN last; the winner by the same order."""

from __future__ import annotations

import math

import pytest

from lorafleet.sweeps import Rung, decide_rung, winner

ORDER = {name: i for i, name in enumerate("abcdefghi")}


@pytest.mark.parametrize(("n", "eta", "keep"), [(9, 3, 3), (3, 3, 1), (2, 3, 1), (8, 3, 2), (5, 2, 2), (4, 4, 1)])
def test_a_rung_keeps_max_1_floor_n_over_eta(n, eta, keep):
    scores = {name: float(i) for i, name in enumerate("abcdefghi"[:n])}
    rung = decide_rung("s", 1, 10, scores, ORDER, eta)
    assert rung.kept == tuple("abcdefghi"[:keep]) and set(rung.dropped) == set("abcdefghi"[keep:n])


def test_ties_go_to_the_earlier_member_and_a_nan_ranks_last():
    rung = decide_rung("s", 2, 40, {"c": 1.0, "b": 1.0, "a": math.nan, "d": 0.5}, ORDER, 2)
    assert rung.kept == ("d", "b") and rung.dropped == ("c", "a")
    assert winner({"c": 1.0, "b": 1.0, "a": math.nan}, ORDER) == "b"
    assert winner({}, ORDER) is None


def test_a_rung_round_trips_through_its_json():
    rung = decide_rung("s", 1, 10, {"a": 2.0, "b": math.inf, "c": 1.0}, ORDER, 3)
    assert Rung.from_json(rung.to_json()) == rung
