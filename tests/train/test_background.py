"""The re-plan beside the steps (``train.background``): its answer, how long the loop waited for it, and its
error raised in the loop's thread."""

from __future__ import annotations

import threading

import pytest

from lorafleet.train.background import BackgroundReplan


def test_the_answer_waits_for_the_replan_and_is_its_answer():
    release, order = threading.Event(), []
    answer = object()

    def replan():
        release.wait()
        order.append("replan done")
        return answer

    running = BackgroundReplan.start(3, 4, replan)
    assert (running.step, running.at) == (3, 4)
    threading.Timer(0.01, lambda: (order.append("released"), release.set())).start()
    got, waited = running.answer()
    assert got is answer and waited > 0 and order == ["released", "replan done"]
    assert running.answer()[0] is answer  # asked again: the same answer


def test_the_replans_error_is_raised_where_its_answer_is_asked():
    def replan():
        raise ValueError("the planner failed")

    running = BackgroundReplan.start(3, 4, replan)
    with pytest.raises(ValueError, match="the planner failed"):
        running.answer()
