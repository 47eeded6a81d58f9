"""Sizing the fleet (``planner.sizing``, ``lorafleet plan --gpus auto``): every objective picks the row the
rows themselves say it should, misses and bad flags are one-line errors, and ``--gpus N`` is unchanged."""

from __future__ import annotations

import copy
import json
import math

import pytest
import yaml

from lorafleet.assemble import workload_cluster
from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.planner import (
    Deadline,
    PlannerOptions,
    SizingError,
    SizingGoal,
    SizingObjective,
    plan_deployment,
    size_fleet,
)
from lorafleet.planner.sizing_choice import judge
from lorafleet.planner.sizing_objective import OBJECTIVE_SOURCE, job_steps
from lorafleet.planner.sizing_search import plan_counts
from lorafleet.plans import DeploymentPlan
from lorafleet.workload import load_workload
from tests.helpers.planning import small_workload
from tests.helpers.repo import SMALL_WORKLOAD

FAST = PlannerOptions(robust_samples=0, baselines=False, time_limit_s=5.0)
STEPS = 1000


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return small_workload(tmp_path_factory.mktemp("sizing"))


@pytest.fixture(scope="module")
def rows(workload, cost_model_7b):
    """8, 16 and 24 GPUs planned once; the objectives below judge these rows."""
    return plan_counts(workload, workload.cluster, cost_model_7b, FAST, max_nodes=3)


def test_every_whole_node_count_is_planned_as_it_would_be_alone(workload, rows, cost_model_7b):
    assert [r.gpus for r in rows] == [8, 16, 24] and [r.cluster.nodes for r in rows] == [1, 2, 3]
    assert all(r.feasible for r in rows)
    # the candidate cluster is the one `plan --gpus n` builds, so the row's plan is that plan
    assert rows[1].cluster == workload_cluster(workload, 16)
    alone = plan_deployment(workload, workload_cluster(workload, 16), cost_model_7b, FAST)
    assert rows[1].result.plan == alone.plan
    assert len({round(r.gpu_seconds_per_step, 6) for r in rows}) == 3  # the choice below is not a tie


def test_the_default_picks_the_fewest_job_gpu_seconds(rows):
    sized = judge(rows, SizingObjective(steps=STEPS), STEPS)
    assert sized.objective.goal is SizingGoal.GPU_SECONDS
    chosen = sized.chosen_row
    for row in sized.rows:
        assert row.job_gpu_hours == pytest.approx(row.step_s * row.used_gpus * STEPS / 3600)
        assert row.job_gpu_hours > chosen.job_gpu_hours or (row.gpus >= chosen.gpus)
    assert chosen.job_gpu_hours == min(r.job_gpu_hours for r in sized.rows)
    # without the job's steps, GPU-seconds per step decide the same way, and the job columns stay empty
    unknown = judge(rows, SizingObjective(), None)
    assert unknown.chosen == sized.chosen and unknown.chosen_row.job_hours is None


def test_a_deadline_picks_the_fewest_gpus_that_meet_it(rows):
    assert rows[0].step_s > rows[1].step_s > rows[2].step_s
    # 16 GPUs finish with 1 % to spare; 8 do not
    hours = rows[1].step_s * STEPS / 3600 * 1.01
    sized = judge(rows, SizingObjective(deadline=Deadline(STEPS, hours)), STEPS)
    meeting = [r.gpus for r in sized.rows if r.step_s * STEPS <= hours * 3600]
    assert sized.chosen_row.gpus == min(meeting) == 16
    smaller = sized.rows[sized.chosen - 1]
    assert smaller.gpus == 8 and smaller.job_hours > hours
    # a deadline 8 GPUs meet picks 8, though 16 and 24 are faster
    loose = judge(rows, SizingObjective(deadline=Deadline(STEPS, rows[0].step_s * STEPS / 3600 * 1.01)), STEPS)
    assert loose.chosen_row.gpus == 8


def test_a_budget_picks_the_fastest_plan_it_pays_for(rows):
    costs = sorted(r.gpu_seconds_per_step * STEPS / 3600 for r in rows)
    # a budget between the second and third cheapest: two counts fit, the faster of them wins
    budget = (costs[1] + costs[2]) / 2
    sized = judge(rows, SizingObjective(budget_gpu_hours=budget, steps=STEPS), STEPS)
    fitting = [r for r in sized.rows if r.job_gpu_hours <= budget]
    assert len(fitting) == 2
    assert sized.chosen_row.step_s == min(r.step_s for r in fitting)
    assert any(r.step_s < sized.chosen_row.step_s for r in sized.rows)  # a faster one is over budget


def test_a_deadline_and_a_budget_pick_the_cheapest_that_meets_both(rows):
    hours = rows[1].step_s * STEPS / 3600 * 1.01  # 16 and 24 GPUs meet it
    budget = max(r.gpu_seconds_per_step for r in rows) * STEPS / 3600 * 2  # all fit
    sized = judge(rows, SizingObjective(deadline=Deadline(STEPS, hours), budget_gpu_hours=budget), STEPS)
    assert sized.objective.goal is SizingGoal.DEADLINE_AND_BUDGET
    both = [r for r in sized.rows if r.job_hours <= hours and r.job_gpu_hours <= budget]
    assert [r.gpus for r in both] == [16, 24]
    assert sized.chosen_row.job_gpu_hours == min(r.job_gpu_hours for r in both)


def test_misses_name_the_limit_and_the_best_found(rows):
    with pytest.raises(SizingError) as miss:
        judge(rows, SizingObjective(deadline=Deadline(STEPS, 0.01)), STEPS)
    assert (miss.value.path, miss.value.field) == (OBJECTIVE_SOURCE, "deadline")
    assert f"the fastest found, 24 GPUs, takes {rows[2].step_s * STEPS / 3600:.3g} h" in miss.value.msg
    assert miss.value.sweep.chosen is None and len(miss.value.sweep.rows) == 3
    cheapest = min(rows, key=lambda r: r.gpu_seconds_per_step)
    with pytest.raises(SizingError, match=f"the cheapest found, {cheapest.gpus} GPUs") as over:
        judge(rows, SizingObjective(budget_gpu_hours=0.01, steps=STEPS), STEPS)
    assert over.value.field == "budget_gpu_hours"
    # each limit alone is met, both together are not: the budget is what is missed
    hours = rows[1].step_s * STEPS / 3600 * 1.01  # 16 and 24 GPUs meet it
    on_time, late = min(r.gpu_seconds_per_step for r in rows[1:]), rows[0].gpu_seconds_per_step
    assert late < on_time  # 8 GPUs are the cheapest: a budget between them fits only the late count
    budget = (late + on_time) / 2 * STEPS / 3600
    with pytest.raises(SizingError, match="meets both") as neither:
        judge(rows, SizingObjective(deadline=Deadline(STEPS, hours), budget_gpu_hours=budget), STEPS)
    assert neither.value.field == "budget_gpu_hours"


def test_a_count_without_a_plan_is_an_infeasible_row(tmp_path, cost_model_7b):
    """20K-token sequences fit no config of one node (the lobra-like M tops out at 16K on 8 GPUs), <8,2> on two."""
    long = small_workload(tmp_path, longest=20_000)
    sized = size_fleet(long, long.cluster, cost_model_7b, FAST)
    assert [r.feasible for r in sized.rows] == [False, True]
    assert "20000-token sequences" in sized.rows[0].infeasible and sized.chosen_row.gpus == 16
    huge = small_workload(tmp_path, longest=40_000)
    with pytest.raises(SizingError) as none:
        size_fleet(huge, huge.cluster, cost_model_7b, FAST)
    assert none.value.path == huge.path and none.value.field == "tasks[2].context_length"
    assert none.value.msg.startswith("no plan on any count swept (8 to 16 GPUs): ")


def test_the_jobs_steps(workload, tmp_path):
    assert job_steps(workload, SizingObjective()) is None
    assert job_steps(workload, SizingObjective(steps=7)) == 7
    assert job_steps(workload, SizingObjective(deadline=Deadline(9, 1.0))) == 9
    stepped = load_workload(
        workload.path, ["tasks.chat.steps=300", "tasks.code.steps=200", "tasks.code.start_step=150"]
    )
    assert job_steps(stepped, SizingObjective()) == 350  # code ends last: step 150 + 200


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: Deadline(0, 1.0), "deadline"),
        (lambda: Deadline(10, -1.0), "deadline"),
        (lambda: SizingObjective(budget_gpu_hours=0.0), "budget_gpu_hours"),
        (lambda: SizingObjective(steps=0), "steps"),
        (lambda: SizingObjective(deadline=Deadline(10, 1.0), steps=10), "steps"),
    ],
)
def test_bad_objectives_name_their_field(make, field):
    with pytest.raises(InputError) as bad:
        make()
    assert (bad.value.path, bad.value.field) == (OBJECTIVE_SOURCE, field)


def test_a_budget_without_steps_and_no_nodes_fail_before_planning(workload, cost_model_7b):
    def refuse(cluster):
        raise AssertionError("planned")

    with pytest.raises(InputError, match="needs the job's steps") as bad:
        size_fleet(workload, workload.cluster, refuse, FAST, SizingObjective(budget_gpu_hours=10.0))
    assert bad.value.field == "steps"
    with pytest.raises(InputError) as bad:
        size_fleet(workload, workload.cluster, refuse, FAST, max_nodes=0)
    assert bad.value.field == "max_nodes"


# --- which counts are planned (#25: --max-nodes 100000 ran for days) -------------------------------


def test_a_deadline_is_found_by_a_search_not_a_scan(workload, rows, cost_model_7b):
    """Up to 4,096 nodes, the smallest count that meets a deadline is found by galloping (1, 2, 4 nodes) and
    bisection (3): three counts planned, not 4,096 (one node is skipped: the lower bound of its step, W / 8,
    already misses), and the count a full scan of 1..3 nodes chooses."""
    hours = rows[2].step_s * STEPS / 3600 * 1.01  # 24 GPUs meet it, 16 do not
    objective = SizingObjective(deadline=Deadline(STEPS, hours))
    planned: list[int] = []
    sized = size_fleet(
        workload,
        workload.cluster,
        cost_model_7b,
        FAST,
        objective,
        max_nodes=4096,
        progress=lambda row, n: planned.append(row.gpus),
    )
    assert planned == [16, 32, 24] and [r.gpus for r in sized.rows] == [16, 24, 32]
    assert sized.chosen_row.gpus == judge(rows, objective, STEPS).chosen_row.gpus == 24


@pytest.fixture(scope="module")
def one_long_task(tmp_path_factory):
    """Two long sequences a step: the least step time of any plan (t_0) is high against its GPU-seconds."""
    spec = {
        "model": "llama2-7b",
        "recompute": "off",
        "cluster": {"gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8},
        "tasks": [{"name": "long", "lengths": {"values": [8000, 6000]}, "batch_size": 2, "context_length": 8192}],
    }
    path = tmp_path_factory.mktemp("long") / "long.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_workload(path)


def test_a_scan_stops_once_no_larger_count_can_be_better(one_long_task):
    """Fewest GPU-seconds (and fastest within a budget) have no order to search in: counts are planned in turn
    until t_0 n reaches the best per-step GPU-seconds found (or the budget's), since a plan on n GPUs costs at
    least t_0 n. Counted: 5 of 4,096 counts planned (3 for a budget of 3 GPU-s a step, which none meets)."""
    from lorafleet.assemble import workload_cost_model
    from lorafleet.planner.sizing_search import CountBounds

    cluster = one_long_task.cluster
    cost_model = lambda candidate: workload_cost_model(one_long_task, candidate)  # noqa: E731
    sized = size_fleet(one_long_task, cluster, cost_model, FAST, SizingObjective(), max_nodes=4096)
    assert [r.gpus for r in sized.rows] == [8, 16, 24, 32, 40]
    assert sized.stopped.startswith("stopped after 40 GPUs: a plan on more than 40 GPUs takes at least")
    bounds = CountBounds.swept(one_long_task, cluster, cost_model, 4096, FAST.policy.pipeline_window)
    best = sized.chosen_row.gpu_seconds_per_step
    assert bounds.floor_s * 40 >= best > bounds.floor_s * 32

    planned: list[int] = []
    budget = SizingObjective(budget_gpu_hours=3 * STEPS / 3600, steps=STEPS)
    with pytest.raises(SizingError, match="none of the counts swept \\(8 to 24 GPUs\\) runs 1000 steps within"):
        size_fleet(
            one_long_task,
            cluster,
            cost_model,
            FAST,
            budget,
            max_nodes=4096,
            progress=lambda row, n: planned.append(row.gpus),
        )
    assert planned == [8, 16, 24] and bounds.floor_s * 24 >= 3.0 > bounds.floor_s * 16


# --- lorafleet plan --gpus auto ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_workload(tmp_path_factory):
    """SMALL_WORKLOAD on two nodes of 8, without recomputing configs (fewer candidates: a fast sweep)."""
    spec = copy.deepcopy(SMALL_WORKLOAD) | {"recompute": "off"}
    spec["cluster"]["nodes"] = 2
    path = tmp_path_factory.mktemp("cli") / "small.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def sweep_rows(text: str) -> list[dict[str, str]]:
    """The sweep table's rows (first line of each), by column."""
    lines = text.splitlines()
    head = next(k for k, line in enumerate(lines) if line.startswith("┃ GPUs"))
    names = [c.strip() for c in lines[head].strip("┃").split("┃")]
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("│"):
            break
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0]:
            rows.append(dict(zip(names, cells, strict=True)))
    return rows


def test_auto_prints_the_sweep_and_writes_the_chosen_plan(cli_workload, tmp_path, capsys):
    auto = tmp_path / "auto.json"
    assert main(["plan", cli_workload, "--gpus", "auto", "--samples", "0", "--json", str(auto)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    progress = captured.err.splitlines()  # one line per count as it is planned
    assert [line.split(" GPUs")[0] for line in progress] == [f"{PROGRESS}8", f"{PROGRESS}16"]
    assert progress[1].endswith("; 2 counts planned]")
    assert "fleet sizing: fewest GPU-seconds" in text and "chosen:" in text
    rows = sweep_rows(text)
    assert [r["GPUs"] for r in rows] == ["8", "16"]
    chosen = [r for r in rows if "chosen" in r["judged"]]
    assert len(chosen) == 1 and float(chosen[0]["GPU-s/step"]) == min(float(r["GPU-s/step"]) for r in rows)
    assert "per step (expected batch)" in text and "task-fused-packing" in text  # then `plan` as usual
    plan = DeploymentPlan.load(auto)
    assert plan.n_gpus == int(chosen[0]["GPUs"]) and plan.describe() == chosen[0]["plan"]
    # the same plan as `--gpus N` of the chosen count, which prints no sweep
    alone = tmp_path / "alone.json"
    assert main(["plan", cli_workload, "--gpus", chosen[0]["GPUs"], "--samples", "0", "--json", str(alone)]) == 0
    assert "fleet sizing" not in capsys.readouterr().out
    assert json.loads(auto.read_text()) == json.loads(alone.read_text())


def test_a_deadline_picks_the_fewest_gpus_meeting_it(cli_workload, capsys):
    argv = ["plan", cli_workload, "--gpus", "auto", "--samples", "0", "--deadline", "1000:0.25"]
    assert main(argv) == 0
    rows = sweep_rows(capsys.readouterr().out)
    meets = [float(r["job h"]) <= 0.25 for r in rows]
    assert meets == [False, True]  # 8 GPUs take ~0.3 h, 16 ~0.2 h: the next-smaller count misses
    assert "chosen" in rows[1]["judged"] and "misses deadline" in rows[0]["judged"]


def test_gpus_n_plans_as_before(cli_workload, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", cli_workload, "--gpus", "8", "--samples", "0", "--json", str(out)]) == 0
    assert "fleet sizing" not in capsys.readouterr().out
    workload = load_workload(cli_workload)
    cluster = workload_cluster(workload, 8)
    from lorafleet.assemble import workload_cost_model

    expected = plan_deployment(
        workload, cluster, workload_cost_model(workload, cluster), PlannerOptions(robust_samples=0)
    )
    direct = tmp_path / "direct.json"
    expected.plan.save(direct)
    assert json.loads(out.read_text()) == json.loads(direct.read_text())


PROGRESS = "lorafleet plan: sizing: "
"""How each progress line of a sweep starts (stderr); the error is the one other line."""


def error_lines(err: str) -> list[str]:
    """stderr without the sweep's progress lines."""
    return [line for line in err.strip().splitlines() if not line.startswith(PROGRESS)]


def one_line_error(capsys) -> str:
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("lorafleet: error: ")
    return lines[0]


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--gpus", "abc"], "--gpus: expected a whole number of GPUs or auto, got 'abc'"),
        (["--gpus", "0"], "--gpus: must be >= 1, got 0"),
        (["--gpus", "12"], "--gpus: 12 GPUs do not fill nodes of 8"),
        (["--gpus", "auto", "--deadline", "2000"], "--deadline: expected STEPS:HOURS (e.g. 2000:1.5), got '2000'"),
        (["--gpus", "auto", "--deadline", "2000:-1"], "--deadline: HOURS must be > 0, got -1"),
        (["--gpus", "auto", "--deadline", "x:1"], "--deadline: expected STEPS:HOURS with STEPS a whole number"),
        (["--gpus", "auto", "--budget", "lots"], "--budget: expected GPU-hours, got 'lots'"),
        (["--gpus", "auto", "--budget", "-3"], "--budget: must be > 0, got -3"),
        (["--gpus", "auto", "--max-nodes", "0"], "--max-nodes: must be > 0, got 0"),
        (["--gpus", "auto", "--max-nodes", "100000"], "--max-nodes: must be at most 4096 (the most nodes a cluster"),
        (["--gpus", "auto", "--deadline", "10:1", "--steps", "10"], "--steps: the deadline gives the steps (10)"),
        (["--gpus", "auto", "--budget", "5"], "--steps: a GPU-hour budget needs the job's steps"),
        (["--deadline", "2000:1.5"], "--deadline: goes with --gpus auto"),
        (["--gpus", "8", "--budget", "5"], "--budget: goes with --gpus auto"),
        (["--max-nodes", "2"], "--max-nodes: goes with --gpus auto"),
    ],
)
def test_bad_sizing_flags_are_one_line_errors(cli_workload, tmp_path, capsys, flags, says):
    out = tmp_path / "plan.json"
    assert main(["plan", cli_workload, *flags, "--json", str(out)]) == 2
    assert says in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "flags,says",
    [
        (  # 8 GPUs may make 0.972 s a step (the bound: 0.862 s), and take 1.07 s
            ["--deadline", "1000:0.27"],
            "--deadline: none of the counts swept (8 GPUs) finishes 1000 steps within 0.27 h",
        ),
        (  # 8 GPUs may cost 7.92 GPU-s a step (the bound: 6.9), and cost 8.58
            ["--budget", "2.2", "--steps", "1000"],
            "--budget: none of the counts swept (8 GPUs) runs 1000 steps within 2.2",
        ),
    ],
)
def test_an_unmet_goal_prints_the_sweep_and_one_error_line(cli_workload, tmp_path, capsys, flags, says):
    """(A goal the bounds show no count can meet is refused before any planning: the test below.)"""
    out = tmp_path / "plan.json"
    assert main(["plan", cli_workload, "--gpus", "auto", "--max-nodes", "1", "--samples", "0", *flags]) == 2
    captured = capsys.readouterr()
    err = error_lines(captured.err)
    assert len(err) == 1 and says in err[0]
    assert "found, 8 GPUs" in err[0]
    assert [r["GPUs"] for r in sweep_rows(captured.out)] == ["8"] and "none chosen" in captured.out
    assert not out.exists()


@pytest.mark.parametrize(
    "flags,says",
    [
        (
            ["--deadline", "1000:0.01"],
            "--deadline: no count finishes 1000 steps within 0.01 h: even 4096 nodes take at least 0.",
        ),
        (
            ["--budget", "0.01", "--steps", "1000"],
            "--budget: no count runs 1000 steps within 0.01 GPU-hours: every plan's step costs at least 6.69 GPU-s",
        ),
    ],
)
def test_a_goal_no_count_can_meet_is_refused_before_planning(cli_workload, capsys, flags, says):
    """The lower bounds of any plan (``CountBounds``: the hardest sequence's least stage time, the batch's least
    GPU-seconds) show it without planning a count, even with the most nodes (#25)."""
    assert main(["plan", cli_workload, "--gpus", "auto", "--max-nodes", "4096", "--samples", "0", *flags]) == 2
    captured = capsys.readouterr()
    assert error_lines(captured.err) == [captured.err.strip()] and says in captured.err  # nothing planned
    assert sweep_rows(captured.out) == [] and "none chosen" in captured.out


def test_no_count_with_a_plan_is_one_line_naming_the_task(tmp_path, capsys):
    spec = copy.deepcopy(SMALL_WORKLOAD) | {"recompute": "off"}
    spec["tasks"][1] |= {"context_length": 200_000, "lengths": {"histogram": {150_000: 1, 100: 1}}}
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--gpus", "auto", "--max-nodes", "2", "--json", str(out)]) == 2
    err = one_line_error(capsys)
    assert "tasks[1].context_length: no plan on any count swept (8 to 16 GPUs)" in err
    assert not out.exists()


def test_the_deadline_math(rows):
    """H(n) = t̂(n) S / 3600 and C(n) = t̂(n) G(n) S / 3600, as the docstring states."""
    sized = judge(rows, SizingObjective(deadline=Deadline(STEPS, 100.0)), STEPS)
    for row in sized.rows:
        assert math.isclose(row.job_hours, row.step_s * STEPS / 3600)
        assert math.isclose(row.job_gpu_hours, row.step_s * row.used_gpus * STEPS / 3600)
