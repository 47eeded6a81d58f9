"""Simulated executor, the step loop, schedule replay, reports and what-if sweeps."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.cli import main
from lorafleet.executor.simulated import FailureSpec, SimulatedExecutor, SimulationOptions
from lorafleet.loop import PolicySource, run_loop
from lorafleet.planner import plan_deployment
from lorafleet.sampling import sample_global_batch
from lorafleet.simulate import simulate_schedule
from lorafleet.whatif import Variation, sweep
from lorafleet.workload import load_workload
from tests.conftest import EXAMPLES, SMALL_WORKLOAD


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    import yaml

    path = tmp_path_factory.mktemp("w") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL_WORKLOAD))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster)
    return workload, cost_model, plan_deployment(workload, cluster, cost_model)


def _source(workload, cost_model, result):
    phase = result.schedule.phases[0]
    return PolicySource(lambda s: sample_global_batch(workload, s), phase.plan, cost_model)


def test_noise_free_simulation_equals_the_cost_model(small):
    workload, cost_model, result = small
    plan = result.schedule.phases[0].plan
    executor = SimulatedExecutor(plan, cost_model, [t.name for t in workload.tasks])
    source = _source(workload, cost_model, result)
    for report in run_loop(source, executor, range(3)):
        step_plan = source.plan_for(report.step)
        assert report.makespan_s == pytest.approx(step_plan.estimated_makespan_s, rel=1e-9)
        assert sum(report.task_tokens.values()) == step_plan.tokens  # nothing dropped


def test_stragglers_failures_and_noise(small):
    workload, cost_model, result = small
    plan = result.schedule.phases[0].plan
    names = [t.name for t in workload.tasks]
    source = _source(workload, cost_model, result)
    base = run_loop(source, SimulatedExecutor(plan, cost_model, names), range(4))
    slow = run_loop(source, SimulatedExecutor(plan, cost_model, names, SimulationOptions(slowdown={0: 2.0})), range(4))
    assert all(s.replica_busy_s[0] == pytest.approx(2 * b.replica_busy_s[0]) for s, b in zip(slow, base))
    failing = SimulationOptions(failures=(FailureSpec(step=2, replica_id=1, restart_s=30.0),))
    failed = run_loop(source, SimulatedExecutor(plan, cost_model, names, failing), range(4))
    assert failed[2].failed_replicas == (1,) and failed[2].makespan_s >= 30.0
    assert [r.makespan_s for i, r in enumerate(failed) if i != 2] == [
        r.makespan_s for i, r in enumerate(base) if i != 2
    ]
    noisy = SimulationOptions(noise_sigma=0.05, seed=7)
    one = run_loop(source, SimulatedExecutor(plan, cost_model, names, noisy), range(3))
    two = run_loop(source, SimulatedExecutor(plan, cost_model, names, noisy), range(3))
    assert [r.makespan_s for r in one] == [r.makespan_s for r in two]  # deterministic given the seed
    assert [r.makespan_s for r in one] != [r.makespan_s for r in base[:3]]
    with pytest.raises(ValueError):
        SimulationOptions(slowdown={0: 0.5})


def test_schedules_compare_on_the_same_batches(small):
    workload, cost_model, result = small
    runs = {s.name: simulate_schedule(workload, s, cost_model, 4) for s in (result.schedule, *result.baselines)}
    assert set(runs) == {"lorafleet", "task-fused-padding", "task-fused-packing", "task-sequential"}
    ours = runs["lorafleet"].gpu_seconds.mean()
    assert all(ours <= r.gpu_seconds.mean() * 1.001 for r in runs.values())
    assert len(runs["task-sequential"].phases) == len(workload.tasks)
    assert runs["task-fused-packing"].padding_ratio == 0.0 < runs["task-fused-padding"].padding_ratio
    for run in runs.values():
        assert np.all(run.makespan_s > 0) and 0 < run.utilisation <= 1


def test_simulate_cli_writes_report(tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(
        [
            "simulate",
            str(EXAMPLES / "lobra-7b.yaml"),
            "--gpu",
            "A100-80GB",
            "--steps",
            "2",
            "--noise",
            "0.02",
            "--straggler",
            "0=1.5",
            "--fail",
            "1:2",
            "--report",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "task-fused-padding" in printed and "task-sequential" in printed
    for name in ("makespan.png", "utilisation.png", "lengths.png", "gpu_seconds.png", "index.html"):
        assert (out / name).stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert [m["method"] for m in summary["methods"]][0] == "lorafleet"
    assert summary["methods"][0]["failures"] == 1


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--steps", "0"], "--steps"),
        (["--straggler", "x"], "--straggler"),
        (["--straggler", "0=0.5"], "--noise/--straggler"),
        (["--fail", "a:b"], "--fail"),
        (["--gpus", "12"], "--gpus"),
        (["--gpu", "TPU"], "--gpu"),
    ],
)
def test_simulate_bad_args(capsys, argv, field):
    assert main(["simulate", str(EXAMPLES / "lobra-7b.yaml"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"<args>: {field}:" in err


def test_whatif_sweep_rows(small):
    workload, _, _ = small
    rows = sweep(workload, [Variation.parse("gpus=4,8"), Variation.parse("tasks=none,+pubmedqa,-docs")], steps=2)
    assert len(rows) == 2 * 3 * 4
    by = {(r["vary_gpus"], r["vary_tasks"], r["method"]): r for r in rows}
    assert by[("8", "+pubmedqa", "lorafleet")]["tasks"] == 3 and by[("8", "-docs", "lorafleet")]["tasks"] == 1
    # More GPUs never make lorafleet's step slower on the same workload.
    assert by[("8", "none", "lorafleet")]["step_s"] <= by[("4", "none", "lorafleet")]["step_s"] * 1.02


def test_whatif_recompute_axis(small):
    """``off`` plans no recomputing replica, ``on`` only recomputing ones, for every method."""
    workload, _, _ = small
    rows = sweep(workload, [Variation.parse("recompute=off,on")], steps=2)
    assert len(rows) == 2 * 4
    for row in rows:
        configs = (
            [part.split(" x ")[0].strip() for part in row["plan"].split(" + ")] if "phases" not in row["plan"] else []
        )
        assert all(c.endswith(",rc>") == (row["vary_recompute"] == "on") for c in configs), row


def test_whatif_cli(tmp_path, capsys):
    rc = main(
        [
            "whatif",
            str(EXAMPLES / "lobra-7b.yaml"),
            "--vary",
            "gpu=A100-80GB,H100-80GB",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "whatif.csv").open()))
    h100 = [r for r in rows if r["gpu_kind"] == "H100-80GB" and r["method"] == "lorafleet"][0]
    a100 = [r for r in rows if r["gpu_kind"] == "A100-80GB" and r["method"] == "lorafleet"][0]
    assert float(h100["step_s"]) < float(a100["step_s"])
    assert (tmp_path / "gpu_s_per_step.png").exists() and (tmp_path / "step_s.png").exists()


@pytest.mark.parametrize("vary", ["gpus=x", "nope=1", "tasks=+notapreset", "tasks=-nobody", "gpus=", "recompute=maybe"])
def test_whatif_bad_variations(capsys, vary):
    assert main(["whatif", str(EXAMPLES / "lobra-7b.yaml"), "--vary", vary, "--steps", "1", "--out", "/tmp/lf-wi"]) == 2
    assert "--vary" in capsys.readouterr().err
