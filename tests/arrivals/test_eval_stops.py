"""Evaluations and early stops in ``simulate --arrivals`` (``lorafleet.eval_replay`` on ``arrivals.replay``): a
stopped task departs at its evaluation's boundary, the strategy answers the change, and its evaluations are billed
apart from its steps."""

from __future__ import annotations

import pytest
import yaml

from lorafleet.arrivals import ArrivalOptions, Strategy, load_trace, replay_trace
from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.loss_curve import curve_loss
from lorafleet.specs.loss_curve import LossCurveSpec
from lorafleet.workload import load_workload
from tests.arrivals.test_arrivals import FAST
from tests.arrivals.test_arrivals import WORKLOAD as BASE

CURVE = {"l_inf": 1.0, "a": 0.5, "alpha": 0.5, "rise": 50.0, "rise_after": 0.05}
"""Lowest at 0.05 M tokens: chat trains ~4.7k a step, so its best evaluation is at step 10 of 40."""
CURVE_SPEC = LossCurveSpec.model_validate(CURVE)

WORKLOAD = {
    **BASE,
    "tasks": [
        {**BASE["tasks"][0], "steps": 40, "eval": {"every_steps": 5, "max_rows": 32, "curve": CURVE},
         "early_stopping": {"patience": 2}},
        {**BASE["tasks"][1], "steps": 30, "eval": {"every_steps": 8, "max_rows": 16}},
    ],
}  # fmt: skip
"""test_arrivals's chat and docs, longer, evaluated; chat stops early."""


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stops")
    (tmp / "w.yaml").write_text(yaml.safe_dump(WORKLOAD))
    (tmp / "t.yaml").write_text("events: []\n")
    workload = load_workload(tmp / "w.yaml")
    trace = load_trace(tmp / "t.yaml", workload)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(trace.all_tasks(), cluster)
    options = ArrivalOptions(planner=FAST, strategies=(Strategy.INCREMENTAL, Strategy.STATIC))
    stopped = replay_trace(trace, cluster, cost_model, options)
    reference = replay_trace(
        trace, cluster, cost_model, ArrivalOptions(planner=FAST, strategies=options.strategies, stops=False)
    )
    return stopped, reference


def test_a_stopped_task_departs_at_its_evaluations_boundary(replayed):
    stopped, _ = replayed
    for run in stopped.runs:
        chat, outcome = run.evals["chat"], run.tasks["chat"]
        assert [r.own_step for r in chat.records] == [5, 10, 15, 20]  # the best at 10, patience 2
        assert [r.loss for r in chat.records] == pytest.approx([curve_loss(CURVE_SPEC, r.tokens) for r in chat.records])
        assert chat.state.best_step == 10 and chat.stop_step == 20
        assert outcome.stopped and outcome.steps_done == 20 and not outcome.cancelled
        assert outcome.tokens == chat.records[-1].tokens
        docs = run.evals["docs"]
        assert [r.own_step for r in docs.records] == [8, 16, 24, 30] and not run.tasks["docs"].stopped
        assert run.steps == 30


def test_the_incremental_re_plan_answers_an_early_stop(replayed):
    stopped, reference = replayed
    incremental = stopped.run(Strategy.INCREMENTAL)
    assert [c.tasks for c in incremental.changes] == [("chat", "docs"), ("docs",)]
    assert incremental.plans == 2 and reference.run(Strategy.INCREMENTAL).plans == 2  # chat leaves at 20 or 40
    assert stopped.run(Strategy.STATIC).plans == 1


def test_evaluations_are_billed_apart_and_the_stop_saves_gpu_seconds(replayed):
    stopped, reference = replayed
    for run, ref in zip(stopped.runs, reference.runs):
        evals = sum(o.eval_gpu_s for o in run.tasks.values())
        assert evals == pytest.approx(run.eval_gpu_s) and run.eval_gpu_s > 0
        assert run.gpu_s == pytest.approx(run.step_gpu_s + run.eval_gpu_s + run.migration_gpu_s)
        assert ref.tasks["chat"].steps_done == 40 and not ref.tasks["chat"].stopped
        assert len(ref.evals["chat"].records) == 8
        assert ref.gpu_s > run.gpu_s  # chat's 20 steps (and 4 evaluations) not taken
