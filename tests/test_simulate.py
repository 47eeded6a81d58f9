"""Schedule replay (``lorafleet.simulate``) and ``lorafleet simulate``, reports and what-if sweeps (the simulated
executor on the step loop: ``tests/executor/test_simulated.py``)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.cli import main
from lorafleet.executor.simulated import SimulationOptions
from lorafleet.planner import plan_deployment
from lorafleet.simulate import simulate_schedule
from lorafleet.whatif import Variation, sweep
from lorafleet.workload import load_workload
from tests.helpers.repo import EXAMPLES


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


def test_each_task_pays_its_share_of_every_schedule(small, tmp_path):
    """Per-task GPU-seconds add up, per step and over the run, to each method's GPU-seconds; under
    Task-Sequential a task pays exactly its own phase; the HTML report and summary.json show lorafleet's."""
    from lorafleet.report import task_cost_rows, write_report

    workload, cost_model, result = small
    names = [t.name for t in workload.tasks]
    options = SimulationOptions(noise_sigma=0.05, slowdown={0: 1.5}, seed=3)
    runs = [simulate_schedule(workload, s, cost_model, 3, options) for s in (result.schedule, *result.baselines)]
    for run in runs:
        owed = run.task_gpu_seconds
        assert list(owed) == names and min(owed.values()) > 0
        assert sum(owed.values()) == pytest.approx(run.gpu_seconds.sum(), rel=1e-12)
        per_step = [sum(step.values()) for step in run.task_gpu_seconds_per_step]
        assert per_step == pytest.approx(list(run.gpu_seconds), rel=1e-12)
        assert run.task_tokens == {n: sum(r.task_tokens[n] for p in run.phases for r in p.reports) for n in names}
    sequential = next(r for r in runs if r.name == "task-sequential")
    for phase in sequential.phases:
        (task,) = phase.phase.tasks
        own = sum(r.makespan_s for r in phase.reports) * phase.phase.plan.used_gpus
        assert sequential.task_gpu_seconds[names[task]] == pytest.approx(own, rel=1e-12)

    rows = task_cost_rows(runs[0])
    assert [r["task"] for r in rows] == names
    assert sum(float(str(r["share"]).removesuffix(" %")) for r in rows) == pytest.approx(100, abs=0.1)
    for row in rows:
        assert row["gpu_s_per_1k_tokens"] == pytest.approx(1000 * row["gpu_s"] / row["tokens"])
    cluster = workload_cluster(workload)
    page = write_report(tmp_path, workload, runs, [{"replica": 0}], cluster=cluster, cost_source=cost_model.source)
    page = page.read_text()
    assert "GPU-seconds per task" in page
    for header in ("task", "tokens", "gpu_s", "share", "gpu_s_per_1k_tokens"):
        assert f"<th>{header}</th>" in page
    assert f"<td>{rows[0]['share']}</td>" in page and str(rows[0]["share"]).endswith(" %")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [c["task"] for c in summary["task_costs"]] == names
    assert sum(c["gpu_s"] for c in summary["task_costs"]) == pytest.approx(runs[0].gpu_seconds.sum())


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
    assert [c["task"] for c in summary["task_costs"]] and "GPU-seconds per task" in (out / "index.html").read_text()


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--steps", "0"], "--steps"),
        (["--straggler", "x"], "--straggler"),
        (["--straggler", "0=0.5"], "--noise/--straggler"),
        (["--noise", "1000"], "--noise"),  # exp(1000 Z) overflowed into a ValueError traceback
        (["--noise", "-0.1"], "--noise"),
        (["--noise", "nan"], "--noise"),
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


def test_whatif_window_axis(small):
    """A window prices every pipelined replica's bubble at most as 1F1B flushed every step does: no
    method's step gets slower with it (a replica without a pipeline costs the same)."""
    workload, _, _ = small
    rows = sweep(workload, [Variation.parse("gpus=8"), Variation.parse("window=1,8")], steps=2)
    by = {(r["vary_window"], r["method"]): r for r in rows}
    assert {w for w, _ in by} == {"1", "8"}
    for (window, method), row in by.items():
        if window == "8":
            assert row["gpu_s_per_step"] <= by[("1", method)]["gpu_s_per_step"] * 1.02, method


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


@pytest.mark.parametrize(
    "vary", ["gpus=x", "nope=1", "tasks=+notapreset", "tasks=-nobody", "gpus=", "recompute=maybe", "window=0"]
)
def test_whatif_bad_variations(capsys, vary):
    assert main(["whatif", str(EXAMPLES / "lobra-7b.yaml"), "--vary", vary, "--steps", "1", "--out", "/tmp/lf-wi"]) == 2
    assert "--vary" in capsys.readouterr().err


def test_a_share_is_honoured_in_simulation(tmp_path):
    """A task with ``share`` takes part in the steps that keep it near that fraction of the tokens, as the
    torch executor's streams draw them (``lorafleet.turns``); the others run every step."""
    import yaml

    from lorafleet.planner import PlannerOptions
    from lorafleet.simulate import simulate_schedule

    spec = {
        "model": "llama2-7b",
        "cluster": {"gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8},
        "tasks": [
            {"name": "chat", "lengths": {"values": [200, 300, 400]}, "batch_size": 32, "context_length": 1024},
            {
                "name": "docs",
                "lengths": {"values": [800, 1000]},
                "batch_size": 16,
                "context_length": 2048,
                "share": 0.1,
            },
        ],
    }
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(spec))
    workload = load_workload(path)
    cost_model = workload_cost_model(workload, workload.cluster)
    result = plan_deployment(workload, workload.cluster, cost_model, PlannerOptions(robust_samples=0, baselines=False))
    run = simulate_schedule(workload, result.schedule, result.cost_model, 60)
    tokens = run.task_tokens
    assert tokens["docs"] / (tokens["docs"] + tokens["chat"]) == pytest.approx(0.1, abs=0.03)
    steps_with_docs = sum(r.task_tokens.get("docs", 0) > 0 for r in run.phases[0].reports)
    assert 0 < steps_with_docs < 60 and all(r.task_tokens["chat"] > 0 for r in run.phases[0].reports)


def test_a_run_on_two_pools_reports_each_pools_use_and_cost(tmp_path):
    """#29: per-pool GPUs held, utilisation and GPU-seconds, and the cost at the pools' prices: per step
    (the makespan x Σ price x GPUs) and over the run, in the tables, the HTML report and summary.json."""
    from lorafleet.planner.schedule import Phase, Schedule
    from lorafleet.report import pool_rows, summary_rows, write_report
    from tests.helpers.pools import pools_fleet

    workload, cluster, cost_model, plan = pools_fleet(tmp_path)
    schedule = Schedule(name="lorafleet", phases=(Phase(tasks=(0, 1), plan=plan),))
    run = simulate_schedule(workload, schedule, cost_model, 3)
    usage = run.pool_usage()
    assert {p: u.gpus for p, u in usage.items()} == {"a100": 2, "h100": 7}
    assert sum(u.gpu_seconds for u in usage.values()) == pytest.approx(run.gpu_seconds.sum())
    assert all(0 < u.utilisation <= 1 for u in usage.values())
    per_second = (1.3 * 2 + 2.5 * 7) / 3600
    assert run.cost_per_step(cluster) == pytest.approx(run.makespan_s * per_second)
    rows = {r["pool"]: r for r in pool_rows(run, cluster)}
    assert rows["h100"]["gpus_held"] == 7 and rows["a100"]["gpu"] == "A100-40GB"
    assert sum(r["cost_run"] for r in rows.values()) == pytest.approx(run.cost_per_step(cluster).sum())
    (method,) = summary_rows([run], cluster)
    assert method["cost_per_step"] == pytest.approx(float(np.mean(run.makespan_s)) * per_second)
    unpriced = cluster.model_copy(
        update={"pools": (cluster.pools[0].model_copy(update={"price_per_gpu_hour": None}), cluster.pools[1])}
    )
    assert run.cost_per_step(unpriced) is None and "cost_per_step" not in summary_rows([run], unpriced)[0]
    assert "cost_run" not in pool_rows(run, unpriced)[0] and "cost_run" in pool_rows(run, unpriced)[1]
    write_report(tmp_path / "report", workload, [run], [{"replica": 0}], cluster=cluster, cost_source=cost_model.source)
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Pools: what lorafleet holds" in page and "<td>h100</td>" in page and "<th>cost_per_step</th>" in page
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert [p["pool"] for p in summary["pools"]] == ["a100", "h100"]
    assert summary["cluster"] == {"gpu": "A100-40GB + H100-80GB", "gpus": 16}
