"""``lorafleet plan`` through ``lorafleet.cli.main``: tables, JSON, plot, and one-line errors."""

from __future__ import annotations

import gc
import io

import pytest

from lorafleet.cli import build_parser, main
from lorafleet.plans import DeploymentPlan
from tests.helpers.planning import LINE_WIDTH, small_workload, wide_fleet, widest_line, write_workload


@pytest.fixture(scope="module")
def workload_path(tmp_path_factory):
    return small_workload(tmp_path_factory.mktemp("wl")).path


def test_cli_surface_is_frozen():
    """A new option of `plan` must be added here on purpose (as `train`'s are in test_train.py).
    --max-nodes, --deadline, --budget and --steps size the fleet with --gpus auto (docs/planner.md);
    --objective and --makespan-tolerance choose between plans (#29: the cost objective); --step-limit bounds the
    cost objective's step and --max-cost its job's cost (#43); --stats prints the planner's work counters (#26)."""
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    assert sorted(o for a in plan._actions for o in a.option_strings) == [
        "--budget",
        "--deadline",
        "--gpu",
        "--gpus",
        "--help",
        "--json",
        "--makespan-tolerance",
        "--max-cost",
        "--max-nodes",
        "--microbatch",
        "--mode",
        "--objective",
        "--pipeline-window",
        "--plot",
        "--profile",
        "--samples",
        "--set",
        "--solver",
        "--stats",
        "--step-limit",
        "--steps",
        "-h",
    ]


def test_plan_prints_tables_and_writes_json_and_plot(workload_path, tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "load.png"
    thresholds = gc.get_threshold()
    assert main(["plan", workload_path, "--samples", "2", "--json", str(out), "--plot", str(png)]) == 0
    assert gc.get_threshold() == thresholds  # collected less often while the command runs only
    text = capsys.readouterr().out
    for word in (
        "config",
        "token share",
        "time/replica",
        "lorafleet",
        "task-fused-padding",
        "task-fused-packing",
        "task-sequential",
        "GPU-seconds",
    ):
        assert word in text
    plan = DeploymentPlan.load(out)
    assert plan.replicas and plan.expected_makespan_s > 0
    assert len(plan.expected_replica_time_s) == len(plan.replicas)  # every replica's figure
    assert png.stat().st_size > 1000
    assert widest_line(text) <= LINE_WIDTH
    assert "work: " in text and "deployments judged" in text  # the work counters, in the notes


def test_the_plan_table_has_a_row_per_config_at_any_fleet_size(tmp_path):
    """188 replicas: one row per config with count, GPUs, token share and the min / median / max of the
    replicas' expected times; no line over 160 characters."""
    from rich.console import Console

    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.commands._replica_groups import WIDTH
    from lorafleet.commands.plan import plan_table
    from lorafleet.dispatch import dispatch_step
    from lorafleet.planner.expected import expected_global_batch
    from lorafleet.workload import load_workload

    workload_path, plan_path = wide_fleet(tmp_path)
    workload, plan = load_workload(workload_path), DeploymentPlan.load(plan_path)
    cost_model = workload_cost_model(workload, workload_cluster(workload))
    step = dispatch_step(expected_global_batch(workload), plan, cost_model)
    console = Console(width=WIDTH, record=True, file=io.StringIO())
    console.print(plan_table(plan, step))
    text = console.export_text()
    assert widest_line(text) <= LINE_WIDTH
    rows = [line.split("│")[1:6] for line in text.splitlines() if line.startswith("│ <")]
    assert [(r[0].strip(), int(r[1]), int(r[2])) for r in rows] == [
        ("<1,1>", 144, 144),
        ("<2,1>", 40, 80),
        ("<8,1>", 4, 32),
    ]
    assert sum(float(r[4].strip(" %")) for r in rows) == pytest.approx(100, abs=0.2)  # token shares


@pytest.mark.parametrize(
    "flags,where",
    [
        (["--gpus", "0"], "--gpus"),
        (["--gpus", "12"], "--gpus"),  # not whole nodes of 8
        (["--solver", "gurobi"], "--solver"),
        (["--mode", "magic"], "--mode"),
        (["--microbatch", "zip"], "--microbatch"),
        (["--samples", "-1"], "--samples"),
        (["--gpu", "TPU"], "--gpu"),
        (["--pipeline-window", "0"], "--pipeline-window: must be >= 1 step, got 0"),
        (["--objective", "speed"], "--objective: 'speed' is not one of makespan, cost"),
        (["--makespan-tolerance", "1.5"], "--makespan-tolerance: must be in [0, 1), got 1.5"),
        (["--objective", "cost"], "--objective: cost needs a price_per_gpu_hour on every pool"),
    ],
)
def test_bad_flags_are_one_line_errors(workload_path, tmp_path, capsys, flags, where):
    out = tmp_path / "plan.json"
    assert main(["plan", workload_path, *flags, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and where in err and err.startswith("lorafleet: error:")
    assert not out.exists()


HUGE = [{"name": "huge", "batch_size": 2, "context_length": 200_000, "histogram": {150_000: 1, 100: 1}}]


def test_unholdable_sequences_are_an_error_and_nothing_is_written(tmp_path, capsys):
    path = write_workload(tmp_path / "huge.yaml", HUGE, recompute="off")
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "tasks[0].context_length" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_recompute_lets_a_replica_hold_what_no_plain_config_can(tmp_path, capsys):
    """150K tokens exceed every plain config's M on 16 x A100-40GB, not <8,1,rc>'s (~300K); the
    plot labels recomputing configs too."""
    path = write_workload(tmp_path / "huge.yaml", HUGE, recompute="auto")
    out, png = tmp_path / "plan.json", tmp_path / "load.png"
    assert main(["plan", str(path), "--samples", "0", "--json", str(out), "--plot", str(png)]) == 0
    plan = DeploymentPlan.load(out)
    holders = [r for r in plan.replicas if r.max_tokens >= 150_000]
    assert holders and all(r.config.recompute for r in holders)
    assert png.stat().st_size > 0


@pytest.mark.parametrize("window", [None, "1", "3"])
def test_the_pipeline_window_is_recorded_in_the_plans_policy(workload_path, tmp_path, capsys, window):
    out = tmp_path / "plan.json"
    flags = ["--pipeline-window", window] if window else []
    assert main(["plan", workload_path, "--samples", "0", *flags, "--json", str(out)]) == 0
    expected = int(window or 8)
    assert f"pipeline window {expected}" in capsys.readouterr().out
    assert DeploymentPlan.load(out).policy.pipeline_window == expected


def test_a_plan_on_priced_pools_prints_its_cost_and_the_cost_objective_is_cheaper(tmp_path, capsys):
    """#29: with prices, the comparison has a cost column and the plan its cost a step; --objective cost
    within a 20% makespan tolerance finds a step no dearer than the fastest plan's."""
    import yaml

    from tests.helpers.pools import POOLS_WORKLOAD

    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(POOLS_WORKLOAD))
    costs = {}
    for objective in ("makespan", "cost"):
        out = tmp_path / f"{objective}.json"
        flags = ["--objective", objective, "--makespan-tolerance", "0.2", "--samples", "0", "--json", str(out)]
        assert main(["plan", str(path), *flags]) == 0
        text = capsys.readouterr().out
        assert "lorafleet: cost" in text and "a step at the pools' prices" in text
        line = next(x for x in text.splitlines() if "a step at the pools' prices" in x)
        costs[objective] = float(line.split()[1])
        assert [p.name for p in DeploymentPlan.load(out).pools] == ["a100", "h100"]
    assert costs["cost"] <= costs["makespan"]


@pytest.fixture(scope="module")
def pools_path(tmp_path_factory):
    import yaml

    from tests.helpers.pools import POOLS_WORKLOAD

    path = tmp_path_factory.mktemp("pools") / "pools.yaml"
    path.write_text(yaml.safe_dump(POOLS_WORKLOAD))
    return str(path)


def test_the_cost_objective_prints_its_frontier_and_keeps_a_deadline(pools_path, tmp_path, capsys):
    """#43: ``--objective cost`` prints the cost frontier (fastest first, each point cheaper than the one before,
    the chosen plan on it) and records it in the plan; ``--deadline STEPS:HOURS`` without ``--gpus auto`` is its
    step-time limit (3600 HOURS / STEPS), which the plan keeps and records."""
    out = tmp_path / "cost.json"
    assert main(["plan", pools_path, "--objective", "cost", "--samples", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cost frontier (expected batch)" in text
    rows = [line.split("│")[1:7] for line in text.splitlines() if line.startswith("│") and "@" in line.split("│")[-2]]
    steps, costs = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert len(rows) >= 3 and steps == sorted(steps) and costs == sorted(costs, reverse=True)
    assert [r[0].strip() for r in rows].count("chosen") == 1
    plan = DeploymentPlan.load(out)
    assert len(plan.cost_frontier) == len(rows) and plan.max_step_s is None
    cheapest = plan.expected_makespan_s

    limit = round(cheapest / 2, 3)
    hours = limit * 1000 / 3600
    out = tmp_path / "deadline.json"
    flags = ["--objective", "cost", "--deadline", f"1000:{hours}", "--samples", "0", "--json", str(out)]
    assert main(["plan", pools_path, *flags]) == 0
    assert f"step-time limit {limit:.4g} s" in capsys.readouterr().out
    bounded = DeploymentPlan.load(out)
    assert bounded.max_step_s == pytest.approx(limit) and bounded.expected_makespan_s <= bounded.max_step_s


def test_max_cost_plans_the_fastest_job_within_it_and_the_plan_records_the_cap(pools_path, tmp_path, capsys):
    """#43: ``--objective cost --max-cost AMOUNT --steps N``: a plan whose N-step job costs at most AMOUNT, its
    step-cost cap AMOUNT / N recorded, read back whole and kept by a re-plan; the cost line says the job against
    the cap."""
    from lorafleet.planner import PlannerOptions

    out = tmp_path / "capped.json"
    flags = ["--objective", "cost", "--max-cost", "3", "--steps", "1000", "--samples", "0", "--json", str(out)]
    assert main(["plan", pools_path, *flags]) == 0
    text = capsys.readouterr().out
    assert "for the 1000-step job against --max-cost 3 (" in text
    plan = DeploymentPlan.load(out)
    assert plan.max_step_cost == pytest.approx(3 / 1000) and plan.max_step_s is None
    prices = dict(plan.prices)
    per_second = sum(prices[r.pool] * r.config.n_gpus for r in plan.replicas) / 3600
    assert plan.expected_makespan_s * per_second <= plan.max_step_cost
    assert DeploymentPlan.from_json(plan.to_json(), "<test>") == plan
    assert PlannerOptions().replanning(plan).max_step_cost == plan.max_step_cost


@pytest.mark.parametrize(
    "flags,where",
    [
        (["--step-limit", "5"], "--step-limit: goes with --objective cost"),
        (["--objective", "cost", "--step-limit", "0"], "--step-limit: must be > 0, got 0"),
        (["--objective", "cost", "--step-limit", "abc"], "--step-limit: expected a number of seconds, got 'abc'"),
        (["--objective", "cost", "--step-limit", "5", "--deadline", "10:1"], "give --step-limit or --deadline"),
        (["--objective", "cost", "--deadline", "2000"], "--deadline: expected STEPS:HOURS"),
        (["--objective", "cost", "--budget", "10"], "--budget: goes with --gpus auto"),
        (["--objective", "cost", "--step-limit", "0.001"], "--step-limit: no deployment found of"),
        (["--objective", "cost", "--mode", "joint-minlp"], "--mode: joint-minlp"),
        (["--max-cost", "5", "--steps", "10"], "--max-cost: goes with --objective cost"),
        (["--objective", "cost", "--max-cost", "5", "--gpus", "auto"], "--max-cost: does not go with --gpus auto"),
        (["--objective", "cost", "--max-cost", "0", "--steps", "10"], "--max-cost: must be > 0, got 0"),
        (["--objective", "cost", "--max-cost", "inf", "--steps", "10"], "--max-cost: must be > 0 and finite"),
        (["--objective", "cost", "--max-cost", "abc"], "--max-cost: expected an amount in the pools' currency"),
        (["--objective", "cost", "--max-cost", "5"], "--max-cost: needs the job's steps"),
        (["--objective", "cost", "--max-cost", "5", "--steps", "0"], "--steps: must be > 0, got 0"),
        (["--objective", "cost", "--max-cost", "5", "--steps", "9", "--deadline", "10:1"], "--steps: the deadline"),
        (["--objective", "cost", "--max-cost", "0.001", "--steps", "1000"], "--max-cost: no deployment found of"),
    ],
)
def test_bad_cost_flags_are_one_line_errors(pools_path, tmp_path, capsys, flags, where):
    out = tmp_path / "plan.json"
    assert main(["plan", pools_path, "--samples", "0", *flags, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and where in err and err.startswith("lorafleet: error:"), err
    assert not out.exists()
