"""A sweep's rules once it runs (``lorafleet.sweeps``): a rung keeps the best ``max(1, floor(n / eta))`` by best eval
loss so far, ties to the earlier member, a NaN last; the winner by the same order. The sweep report
(``lorafleet.sweep_report``) reads the rungs a run recorded, whatever its members' specs say now."""

from __future__ import annotations

import json
import math

import pytest

from lorafleet.rundir import RunDir
from lorafleet.specs.sweep import sweep_members
from lorafleet.specs.workload import TaskSpec
from lorafleet.sweep_report import sweep_results
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


# -- the sweep report (``lorafleet.sweep_report``) over a run's records -------------------------------------------

SIX = {"optimizer.lr": [1e-4, 1e-3], "lora.rank": [4, 8, 16]}  # 6 members, eta 3: rungs 6 -> 2 -> 1


def six_members(every: int, steps: int) -> list[TaskSpec]:
    sweep = {"grid": SIX, "halving": {"eta": 3, "rung_steps": 2}}
    raw = {"name": "s", "lengths": {"values": [8]}, "batch_size": 2, "context_length": 16, "steps": steps,
           "eval": {"every_steps": every}, "sweep": sweep}  # fmt: skip
    return [TaskSpec.model_validate(m) for m in sweep_members(raw)]


def recorded_run(
    root,
    history: dict,
    rungs: dict[int, int],
    dropped: dict[str, int],
    last: int,
    early: dict[str, int] | None = None,
    scores: dict[int, dict[str, float | None]] | None = None,
) -> RunDir:
    """A run directory as training leaves it, every member taking a batch every step: ``evaluations.json`` (each
    member's ``history`` of (global step, loss)) and ``metrics.jsonl``, whose row of step ``b - 1`` holds the
    evaluation after step ``b`` and the rung ``rungs[b]`` decided there (``sweep_rung``, ``sweep_dropped``);
    ``dropped``: member -> the rung that dropped it; ``early``: member -> the boundary it stopped early at; ``last``:
    the steps of those that trained on; ``scores``: boundary -> the scores its rung recorded (``sweep_scores``; none:
    a run from before rungs recorded them)."""
    run = RunDir(root)
    left = {n: b for n, k in dropped.items() for b, k2 in rungs.items() if k2 == k} | (early or {})
    run.evaluations.write_text(json.dumps({
        n: {"history": [[s, loss, 0.5] for s, loss in h], "stopping": {"best_loss": min(x for _, x in h)},
            "stopped_at": left.get(n), "dropped_rung": dropped.get(n)}
        for n, h in history.items()
    }))  # fmt: skip
    rows = []
    for b in range(1, last + 1):
        row = {"step": b - 1, "losses": {n: 1.0 for n in history if left.get(n, last) >= b}}
        evaluated = {n: loss for n, h in history.items() for s, loss in h if s == b}
        if evaluated:
            row["eval_loss"] = evaluated
        if b in rungs:
            row["sweep_rung"] = {"s": rungs[b]}
            row["sweep_dropped"] = {n: k for n, k in dropped.items() if k == rungs[b]}
            if scores and b in scores:
                row["sweep_scores"] = scores[b]
        rows.append(row)
    run.metrics_jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_report_scores_each_rung_by_the_evaluations_through_its_boundary(tmp_path):
    """Off the grid (rungs every 2 steps, evaluations every 3): rung 1 reads the evaluation at 2, rung 2 those at 2,
    3 and 4."""
    six = six_members(every=3, steps=8)
    names = [s.name for s in six]
    history = {
        names[0]: [(2, 5.0)],
        names[1]: [(2, 4.0), (3, 3.5), (4, 3.9)],
        names[2]: [(2, 4.5), (3, 4.4), (4, 3.0), (6, 2.0), (8, 1.5)],
    } | {n: [(2, 9.0)] for n in names[3:]}
    dropped = {names[0]: 1, names[1]: 2} | dict.fromkeys(names[3:], 1)
    (result,) = sweep_results(recorded_run(tmp_path, history, {2: 1, 4: 2}, dropped, 8), six)
    scores = {m.name: m.rung_scores for m in result.members}
    assert scores[names[0]] == (5.0,) and scores[names[1]] == (4.0, 3.5) and scores[names[2]] == (4.5, 3.0)
    assert [(r.rung, r.step) for r in result.rungs] == [(1, 2), (2, 4)]
    assert result.winner == names[2] and result.table()[0][3:5] == ["rung 1", "rung 2"]


def test_an_every_steps_changed_mid_run_does_not_move_a_rungs_evaluations(tmp_path):
    """Evaluated every 3 steps to step 4, then every step (a PATCH): the members' spec now says ``every_steps: 1``,
    which would put the evaluation at 3 before rung 1; the run recorded rung 1 after the one at 2."""
    six = six_members(every=1, steps=8)  # the spec as it is now
    names = [s.name for s in six]
    history = {
        names[0]: [(2, 5.0)],
        names[1]: [(2, 4.0), (3, 3.5), (4, 3.9)],
        names[2]: [(2, 4.5), (3, 3.2), (4, 3.4), (5, 3.1), (6, 2.0), (7, 1.9), (8, 1.5)],
    } | {n: [(2, 9.0)] for n in names[3:]}
    dropped = {names[0]: 1, names[1]: 2} | dict.fromkeys(names[3:], 1)
    (result,) = sweep_results(recorded_run(tmp_path, history, {2: 1, 4: 2}, dropped, 8), six)
    scores = {m.name: m.rung_scores for m in result.members}
    assert scores[names[1]] == (4.0, 3.5) and scores[names[2]] == (4.5, 3.2)
    assert all(scores[n] == (9.0,) for n in names[3:])


def test_a_run_resumed_with_more_steps_reports_only_the_rungs_it_decided(tmp_path):
    """4 steps, then resumed to 8: rung 1 at 2 kept two members; at 4, their last step then, no rung was decided,
    and after the resume none is (the sweep's rungs, 6 -> 2 -> 1, end at own step 4, passed). The spec now says
    8 steps, by which own step 4 would be rung 2: the report has rung 1 alone."""
    six = six_members(every=3, steps=8)
    names = [s.name for s in six]
    history = {
        names[0]: [(2, 4.0), (3, 3.5), (4, 3.4), (6, 3.3), (8, 3.2)],
        names[1]: [(2, 4.2), (3, 3.0), (4, 2.9), (6, 2.8), (8, 2.7)],
    } | {n: [(2, 9.0)] for n in names[2:]}
    dropped = dict.fromkeys(names[2:], 1)
    (result,) = sweep_results(recorded_run(tmp_path, history, {2: 1}, dropped, 8), six)
    assert [(r.rung, r.step) for r in result.rungs] == [(1, 2)]
    assert {m.name: m.rung_scores for m in result.members[:2]} == {names[0]: (4.0,), names[1]: (4.2,)}
    assert result.winner == names[1] and result.table()[0][3:5] == ["rung 1", "best eval loss"]
    assert [m.outcome for m in result.members[:2]] == ["trained to its end"] * 2


def test_a_member_that_stops_early_at_a_rung_boundary_is_not_judged_by_that_rung(tmp_path):
    """Its early stop is decided by the evaluation at the boundary, before the rung (``train.evaluation``): the rung
    judges the five others, though that evaluation evaluated all six."""
    six = six_members(every=3, steps=8)
    names = [s.name for s in six]
    history = {names[0]: [(2, 4.0), (3, 3.0), (6, 2.0), (8, 1.0)], names[3]: [(2, 1.5)]}
    history |= {n: [(2, 5.0 + i)] for i, n in enumerate(names) if n not in history}
    dropped = dict.fromkeys([n for n in names if n not in (names[0], names[3])], 1)  # 5 judged: keep(5) = 1
    run = recorded_run(tmp_path, history, {2: 1}, dropped, 8, early={names[3]: 2})
    (result,) = sweep_results(run, six)
    member = {m.name: m for m in result.members}
    assert member[names[3]].rung_scores == () and member[names[3]].outcome == "stopped early at step 2"
    assert all(member[n].rung_scores == (history[n][0][1],) for n in names if n != names[3])
    assert result.winner == names[0]


def test_the_report_shows_the_scores_the_rungs_recorded(tmp_path):
    """With ``early_stopping.min_delta > 0`` a rung ranks by the early stopper's best, which a smaller improvement does
    not move: member 1's 3.95 at step 4 is no new best over its 4.0, so rung 2 recorded 4.0, not the history's
    minimum; the report shows what each rung recorded (None: no finite loss), not a minimum re-derived."""
    six = six_members(every=2, steps=8)
    names = [s.name for s in six]
    history = {names[0]: [(2, 5.0)], names[1]: [(2, 4.0), (4, 3.95)], names[2]: [(2, 4.5), (4, 3.0), (6, 2.0)]}
    history |= {n: [(2, 9.0)] for n in names[3:]}
    dropped = {names[0]: 1, names[1]: 2} | dict.fromkeys(names[3:], 1)
    recorded = {2: {names[0]: 5.0, names[1]: 4.0, names[2]: 4.5} | {n: 9.0 for n in names[3:]},
                4: {names[1]: 4.0, names[2]: 3.0}}  # fmt: skip
    recorded[2][names[5]] = None
    (result,) = sweep_results(recorded_run(tmp_path, history, {2: 1, 4: 2}, dropped, 8, scores=recorded), six)
    scores = {m.name: m.rung_scores for m in result.members}
    assert scores[names[1]] == (4.0, 4.0) and scores[names[2]] == (4.5, 3.0)
    assert scores[names[5]] == (math.inf,) and scores[names[4]] == (9.0,)
