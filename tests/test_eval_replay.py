"""Evaluations and early stops replayed by ``simulate`` (``lorafleet.eval_replay`` on ``simulate_schedule``): when a
task is evaluated, what a pass costs and who pays it, the stop and what it saves; counts, not timings."""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.eval_replay import held_out_lengths, held_out_rows, price_evaluation
from lorafleet.loss_curve import curve_loss
from lorafleet.simulate import simulate_schedule
from lorafleet.specs.evaluation import EarlyStoppingSpec, EvalSpec
from lorafleet.specs.loss_curve import LossCurveSpec
from lorafleet.workload import Task, Workload

CURVE = LossCurveSpec(l_inf=1.0, a=0.5, alpha=0.5, rise=5.0, rise_after=0.2)
"""Falls to its lowest at 0.2 M tokens, then rises steeply (chat trains ~15k tokens a step)."""
STOPS = {"eval": {"every_steps": 5, "max_rows": 64, "curve": CURVE.model_dump()}, "early_stopping": {"patience": 2}}
"""chat's eval and early stopping: its best at step 15, its stop at 25."""


def _with_evals(workload: Workload, **by_task: dict) -> Workload:
    tasks = []
    for task in workload.tasks:
        update = {k: (EvalSpec.model_validate(v) if k == "eval" else EarlyStoppingSpec.model_validate(v))
                  for k, v in by_task.get(task.name, {}).items()}  # fmt: skip
        tasks.append(Task(task.spec.model_copy(update=update), task.raw_lengths, task.lengths, task.overflow_fraction))
    spec = workload.spec.model_copy(update={"tasks": tuple(t.spec for t in tasks)})
    return Workload(path=workload.path, spec=spec, model=workload.model, tasks=tuple(tasks))


def test_each_task_is_evaluated_every_n_of_its_steps_and_after_its_last(small):
    workload, cost_model, result = small
    workload = _with_evals(
        workload, chat={"eval": {"every_steps": 5, "max_rows": 64}}, docs={"eval": {"every_steps": 7}}
    )
    run = simulate_schedule(workload, result.schedule, cost_model, 12)
    evals = run.evals
    assert [r.own_step for r in evals["chat"].records] == [5, 10, 12]
    assert [r.own_step for r in evals["docs"].records] == [7, 12]
    assert [r.rows for r in evals["chat"].records] == [64] * 3 and evals["docs"].records[0].rows == 512
    assert all(r.loss is None and not r.stopped for e in evals.values() for r in e.records)  # no curve: no loss
    tokens = np.cumsum([rep.task_tokens["chat"] for rep in run.phases[0].reports])
    assert [r.tokens for r in evals["chat"].records] == [tokens[4], tokens[9], tokens[11]]


def test_an_evaluation_is_billed_to_its_tasks_apart_from_their_steps(small):
    workload, cost_model, result = small
    workload = _with_evals(workload, chat={"eval": {"every_steps": 4, "max_rows": 64}})
    run = simulate_schedule(workload, result.schedule, cost_model, 8)
    plan = result.schedule.phases[0].plan
    records = run.evals["chat"].records
    assert run.eval_gpu_seconds == {"chat": pytest.approx(sum(r.seconds for r in records) * plan.used_gpus)}
    assert run.total_gpu_seconds == pytest.approx(run.gpu_seconds.sum() + run.eval_gpu_seconds["chat"])
    assert run.phases[0].eval_s == pytest.approx(sum(r.seconds for r in records))
    without = simulate_schedule(_with_evals(workload), result.schedule, cost_model, 8)
    assert without.gpu_seconds.sum() == pytest.approx(run.gpu_seconds.sum())  # windows end at evals: same steps here


def test_a_pass_is_the_slowest_replicas_forward_over_the_dispatched_rows(small):
    from lorafleet.dispatch import dispatch_step
    from lorafleet.sampling import TaskDraw, global_batch

    workload, cost_model, result = small
    plan = result.schedule.phases[0].plan
    names = [t.name for t in workload.tasks]
    rows = {"chat": np.full(40, 300), "docs": np.full(6, 3000)}
    cost = price_evaluation(rows, 3, plan, cost_model, names)
    step_plan = dispatch_step(
        global_batch(3, [(0, 0, TaskDraw(rows["chat"], 0, 0)), (1, 0, TaskDraw(rows["docs"], 0, 0))]), plan, cost_model
    )
    forward = [cost_model.forward_time(r.config, [mb.shape for mb in w.microbatches])
               for r, w in zip(plan.replicas, step_plan.work)]  # fmt: skip
    assert cost.seconds == pytest.approx(max(forward))
    assert sum(cost.task_gpu_s.values()) == pytest.approx(cost.seconds * plan.used_gpus)
    assert cost.task_gpu_s["docs"] > cost.task_gpu_s["chat"] > 0  # 18k tokens against 12k, attention quadratic


def test_held_out_rows_split_of_known_rows_else_max_rows(small):
    workload, _, _ = small
    chat = _with_evals(workload, chat={"eval": {"split": 0.02, "max_rows": 100}}).task("chat")
    assert held_out_rows(chat) == 100  # a length distribution knows no rows
    known = Task(chat.spec, chat.raw_lengths, chat.lengths, chat.overflow_fraction, histogram={300: 2000, 500: 1000})
    assert held_out_rows(known) == 60  # round(0.02 x 3000)
    lengths = held_out_lengths(known, seed=0)
    assert lengths.size == 60 and np.array_equal(lengths, held_out_lengths(known, seed=0))
    assert not np.array_equal(lengths, held_out_lengths(known, seed=1))


def test_a_task_with_inline_lengths_holds_out_a_split_of_their_rows(small):
    """``lengths: {values}`` and ``lengths: {histogram}`` of whole counts are rows; fractional weights are not."""
    from lorafleet.specs.workload import LengthSpec

    chat = _with_evals(small[0], chat={"eval": {"split": 0.05, "max_rows": 512}}).task("chat")

    def given(**lengths: object) -> Task:
        spec = chat.spec.model_copy(update={"lengths": LengthSpec.model_validate(lengths)})
        return Task(spec, chat.raw_lengths, chat.lengths, chat.overflow_fraction)

    assert held_out_rows(given(values=list(range(1, 241)))) == 12  # round(0.05 x 240), not max_rows
    assert held_out_rows(given(histogram={100: 150, 300: 90})) == 12
    assert held_out_rows(given(histogram={100: 0.6, 300: 0.4})) == 512  # weights: no rows known


def test_a_preset_task_holds_out_a_split_of_its_datasets_published_rows():
    from lorafleet.specs.length_presets import LOBRA_DATASETS
    from lorafleet.workload import load_workload

    moments = "tasks.python-code.lengths={mean: 269, skewness: 10, kurtosis: 100}"
    workload = load_workload("examples/lobra-7b.yaml", ["defaults.eval.split=0.02", moments])
    assert LOBRA_DATASETS["dolly"].rows == 15_011 and LOBRA_DATASETS["commitpackft"].rows is None
    assert held_out_rows(workload.task("dolly")) == 300  # round(0.02 x 15,011)
    assert held_out_rows(workload.task("meetingbank")) == 138  # round(0.02 x 6,892)
    assert held_out_rows(workload.task("xsum")) == 512  # 2% of 204,045 is over max_rows
    assert held_out_rows(workload.task("commitpackft")) == 512  # no published count for LobRA's subset
    assert held_out_rows(workload.task("python-code")) == 512  # lengths given by moments: no rows


def test_a_task_stops_patience_evaluations_after_its_best_and_takes_no_step_after(small):
    workload, cost_model, result = small
    workload = _with_evals(workload, chat=STOPS)
    run = simulate_schedule(workload, result.schedule, cost_model, 40)
    chat = run.evals["chat"]
    losses = [r.loss for r in chat.records]
    assert losses == pytest.approx([curve_loss(CURVE, r.tokens) for r in chat.records])
    best = int(np.argmin(losses))
    assert len(chat.records) == best + 1 + 2 and chat.state.stopped  # patience 2 after the best
    assert chat.stop_step == chat.records[-1].step == chat.steps == 25
    assert chat.state.best_step == chat.records[best].step == 15
    reports = run.phases[0].reports
    assert all(r.task_tokens.get("chat", 0) > 0 for r in reports[:25])
    assert all(r.task_tokens.get("chat", 0) == 0 for r in reports[25:]) and len(reports) == 40

    reference = simulate_schedule(workload, result.schedule, cost_model, 40, stops=False)
    assert reference.evals["chat"].steps == 40 and not reference.evals["chat"].state.stopped
    assert [r.loss for r in reference.evals["chat"].records[:5]] == losses
    assert reference.total_gpu_seconds > run.total_gpu_seconds  # the steps chat did not take


def test_every_schedule_replays_the_same_stop(small):
    workload, cost_model, result = small
    workload = _with_evals(
        workload, chat={"eval": {"every_steps": 5, "max_rows": 64, "curve": CURVE.model_dump()}, "early_stopping": {}}
    )
    stops = {s.name: simulate_schedule(workload, s, cost_model, 40).evals["chat"].stop_step
             for s in (result.schedule, *result.baselines)}  # fmt: skip
    assert set(stops.values()) == {30}  # patience 3: the same tokens in every method, so the same stop


def test_the_report_shows_the_curves_and_stops(small, tmp_path):
    import json

    from lorafleet.assemble import workload_cluster
    from lorafleet.report import eval_rows, write_report

    workload, cost_model, result = small
    workload = _with_evals(workload, chat=STOPS, docs={"eval": {"every_steps": 10}})
    run = simulate_schedule(workload, result.schedule, cost_model, 30)
    reference = simulate_schedule(workload, result.schedule, cost_model, 30, stops=False)
    rows = eval_rows(run.evals, reference.evals)
    assert rows[0] == {
        "task": "chat", "evals": 5, "eval_gpu_s": pytest.approx(run.eval_gpu_seconds["chat"]), "best_step": 15,
        "best_loss": pytest.approx(run.evals["chat"].state.best_loss), "stopped_at": 25, "steps": 25, "not_taken": 5,
    }  # fmt: skip
    assert rows[1]["stopped_at"] == rows[1]["best_step"] == "-" and rows[1]["not_taken"] == 0
    cluster = workload_cluster(workload)
    write_report(tmp_path, workload, [run], [], cluster=cluster, cost_source=cost_model.source, reference=reference)
    assert (tmp_path / "evals.png").stat().st_size > 0
    assert [r["task"] for r in json.loads((tmp_path / "summary.json").read_text())["evaluations"]] == ["chat", "docs"]
    assert "early stopping saved" in (tmp_path / "index.html").read_text()


RUN_CURVE = LossCurveSpec(l_inf=1.0, a=0.5, alpha=0.5, rise=2.0, rise_after=0.3)
"""The hand-written run's chat curve: lowest at 0.3 M tokens (step 29 of :func:`_metrics_rows`)."""


def _metrics_rows() -> list[dict]:
    """A hand-written run's metrics: chat trains 10,000 tokens a step and is evaluated every 3 of 60 steps, its
    losses on :data:`RUN_CURVE`; docs is evaluated twice; steps 11 and 12 repeat (a resume wrote them again)
    and the rows are out of order."""
    rows = []
    for step in range(60):
        row = {"step": step, "task_tokens": {"chat": 10_000, "docs": 30_000}, "losses": {"chat": 2.0}}
        if step % 3 == 2:
            row["eval_loss"] = {"chat": curve_loss(RUN_CURVE, 10_000 * (step + 1))}
            row["eval_gpu_s"], row["eval_s"] = {"chat": 1.0}, 0.5
        if step in (29, 59):
            row.setdefault("eval_loss", {})["docs"] = 3.0 - step / 100
        rows.append(row)
    return rows[20:] + rows[:13] + rows[11:20]


def test_a_curve_is_fitted_to_each_tasks_evaluations_in_a_runs_metrics(tmp_path):
    import json

    from lorafleet.eval_replay import eval_points, run_curves

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _metrics_rows()))
    fitted = run_curves(tmp_path)
    assert [t for t, _ in fitted.points["chat"]] == [10_000 * (s + 1) for s in range(2, 60, 3)]
    assert fitted.points == eval_points(_metrics_rows()[::-1])  # the steps' order, not the rows'
    chat = fitted.curves["chat"]
    for key in ("l_inf", "a", "alpha", "rise", "rise_after"):
        assert getattr(chat, key) == pytest.approx(getattr(RUN_CURVE, key), rel=1e-3), key
    assert set(fitted.curves) == {"chat"} and "at least 3" in fitted.unfitted["docs"]  # 2 evaluations, the last lowest
    with pytest.raises(ValueError, match="no evaluation"):
        run_curves(_write(tmp_path / "none.jsonl", [{"step": 0, "task_tokens": {"chat": 5}}]))
    with pytest.raises(ValueError, match="no such metrics file"):
        run_curves(tmp_path / "absent")


def _write(path, rows):
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_simulate_replays_the_stop_of_a_curve_fitted_to_a_run(tmp_path, capsys):
    import yaml

    from lorafleet.cli import main
    from tests.helpers.repo import SMALL_WORKLOAD

    workload = _write(tmp_path / "w.yaml", [])
    workload.write_text(yaml.safe_dump(SMALL_WORKLOAD))
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "metrics.jsonl", _metrics_rows())
    sets = ["--set", "tasks.chat.eval.every_steps=5", "--set", "tasks.chat.early_stopping.patience=2"]
    assert main(["simulate", str(workload), "--steps", "40", *sets, "--eval-curves-from", str(run)]) == 0
    out = capsys.readouterr().out
    assert "chat: eval.curve l_inf=1 a=0.5 alpha=0.5 rise=2 rise_after=0.3 (20 evaluations)" in out
    assert "docs: no curve fitted" in out and "early stopping saved" in out  # chat stops at step 30 of 40
    assert main(["simulate", str(workload), "--eval-curves-from", str(tmp_path / "absent")]) == 2
    assert "--eval-curves-from" in capsys.readouterr().err
