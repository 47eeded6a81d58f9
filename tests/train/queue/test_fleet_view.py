"""The live page's data (``train.queue.fleet_view``) from a run directory's files, and how the HTTP server serves
the page and its data: ``metrics.jsonl`` read on from where the last refresh stopped (and again from the start
when a resume rewrote it), each tenant's state from the ledger and its evaluations, its steps from its spec."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lorafleet.costmodel import ParallelConfig
from lorafleet.presets import make_plan
from lorafleet.rundir import RunDir
from lorafleet.specs.io import write_text_atomic
from lorafleet.train.queue import fleet_view, start_queue_server
from lorafleet.train.queue.fleet_view import FleetWatch, TenantState, sampled


def _row(step: int, losses: dict[str, float], busy: tuple[float, ...] = (0.5, 1.0), **extra) -> dict:
    gpu_s = {name: 1.0 for name in losses}
    return {"step": step, "losses": losses, "makespan_s": 1.0, "replica_busy_s": list(busy), "task_gpu_s": gpu_s,
            **extra}  # fmt: skip


def _run(tmp_path: Path, tasks: list[dict], steps: int = 10) -> RunDir:
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    make_plan(((ParallelConfig(1, 1), 1), (ParallelConfig(2, 1, recompute=True), 1)), n_tasks=2).save(run_dir.plan)
    run = {"options": {"steps": steps}, "state": {"workload": {"tasks": tasks}, "lengths": {"ep": [[10, 30]]}}}
    run_dir.run_file.write_text(json.dumps(run))
    return run_dir


def _append(run_dir: RunDir, *rows: dict, partial: str = "") -> None:
    with run_dir.metrics_jsonl.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + partial)


def test_tenants_progress_states_and_replicas(tmp_path):
    """Steps from ``steps``, from ``epochs`` over the rows the run file records, or from the run's; a task that took
    its steps is done, one whose start is ahead waits; the ledger says how the others left; ETAs from the mean step;
    each replica's utilisation is its busy time over the steps'."""
    tasks = [
        {"name": "a", "batch_size": 2, "steps": 3},
        {"name": "ep", "batch_size": 4, "epochs": 2},  # 30 rows: 15 steps, more than the run's 10
        {"name": "late", "batch_size": 2, "start_step": 8},
        {"name": "gone", "batch_size": 2},
    ]
    run_dir = _run(tmp_path, tasks)
    _append(run_dir, *(_row(s, {"a": 3.0 - s, "ep": 2.0, "gone": 1.0}) for s in range(3)))
    ledger = {"tasks": [{"spec": t, "state": "cancelled" if t["name"] == "gone" else "active"} for t in tasks],
              "applied": [{"step": 3, "file": "x.json", "action": "cancel", "name": "gone"}]}  # fmt: skip
    run_dir.ledger.write_text(json.dumps(ledger))
    view = FleetWatch(run_dir).view()
    tenants = {t.name: t for t in view.tenants}
    assert [t.name for t in view.tenants] == ["a", "ep", "late", "gone"]
    assert {n: (t.state, t.steps_done, t.steps_total) for n, t in tenants.items()} == {
        "a": (TenantState.DONE, 3, 3),
        "ep": (TenantState.TRAINING, 3, 10),  # its 15 steps cut to the run's
        "late": (TenantState.WAITING, 0, 2),
        "gone": (TenantState.CANCELLED, 3, 10),
    }
    assert tenants["ep"].eta_s == pytest.approx(7.0) and tenants["a"].eta_s is None
    assert tenants["a"].loss_curve.steps == (1, 2, 3) and tenants["a"].loss_curve.values == (3.0, 2.0, 1.0)
    assert (view.run.steps_done, view.run.steps, view.run.eta_s, view.run.gpu_s) == (3, 10, 7.0, 9.0)
    assert view.run.deployment == "<1,1> x 1 + <2,1,rc> x 1"
    assert [(r.config, r.gpus, r.utilisation) for r in view.replicas] == [("<1,1>", (0,), 0.5), ("<2,1,rc>", (1, 2), 1)]
    record = {"steps": 10, "tasks": [{"name": "ep", "in_run": 6}]}  # rank 0's count (train.run_length) wins
    run_dir.run_length.write_text(json.dumps(record))
    assert {t.name: t.steps_total for t in FleetWatch(run_dir).view().tenants}["ep"] == 6


def test_a_shared_tenants_eta_follows_its_own_progress_rate(tmp_path):
    """A task with a ``share`` takes a batch on some steps only: before it has taken one its ETA is the share's
    expectation (σ T / τ, T the unshared tasks' tokens over 1 - Σσ), then the steps it took per fleet step in the
    metrics; an unshared task's stays one step a step."""
    tasks = [
        {"name": "ep", "batch_size": 4, "steps": 10},  # τ = 4 x 10 tokens (the run file's rows of 10)
        {"name": "sh", "batch_size": 4, "steps": 10, "share": 0.2},
    ]
    run_dir = _run(tmp_path, tasks)
    run = json.loads(run_dir.run_file.read_text())
    run["state"]["lengths"]["sh"] = [[20, 5]]  # τ = 80: T = 40 / 0.8 = 50, r = 0.2 x 50 / 80 = 0.125
    run_dir.run_file.write_text(json.dumps(run))
    _append(run_dir, _row(0, {"ep": 2.0}))
    watch = FleetWatch(run_dir)
    tenants = {t.name: t for t in watch.view().tenants}
    assert tenants["ep"].eta_s == pytest.approx(9.0) and tenants["sh"].eta_s == pytest.approx(10 / 0.125)
    _append(run_dir, *(_row(s, {"ep": 2.0, **({"sh": 1.0} if s % 3 == 0 else {})}) for s in range(1, 7)))
    tenants = {t.name: t for t in watch.view().tenants}  # sh took fleet steps 4 and 7 of the 7: 2 / 7 a step
    assert (tenants["sh"].steps_done, tenants["sh"].eta_s) == (2, pytest.approx(8 / (2 / 7)))
    assert tenants["ep"].eta_s == pytest.approx(3.0)


def test_metrics_are_read_on_and_again_after_a_resume(tmp_path):
    """A refresh folds in only the rows written since the last; a line not ended yet waits for the next; a resume's
    rewrite (a new file, shorter) is read from the start; a non-finite loss is sent as null."""
    run_dir = _run(tmp_path, [{"name": "a", "batch_size": 2}])
    watch = FleetWatch(run_dir)
    assert watch.view().tenants[0].steps_done == 0
    _append(run_dir, _row(0, {"a": 2.0}), partial='{"step": 1, "los')
    assert watch.view().tenants[0].loss_curve.values == (2.0,)
    with run_dir.metrics_jsonl.open("a") as f:
        f.write('ses": {"a": 1.5}, "makespan_s": 1.0}\n')
    _append(run_dir, _row(2, {"a": float("nan")}))
    assert watch.view().tenants[0].loss_curve == sampled((1, 2, 3), (2.0, 1.5, None))
    write_text_atomic(run_dir.metrics_jsonl, json.dumps(_row(0, {"a": 4.0})) + "\n")  # a resume from step 1
    view = watch.view()
    assert view.tenants[0].loss_curve.values == (4.0,) and view.run.steps_done == 1
    assert json.loads(json.dumps(view.to_json(), allow_nan=False))["tenants"][0]["loss"] == 4.0


def test_a_long_curve_is_sampled_with_its_last_point():
    curve = sampled(range(1, 1001), [float(s) for s in range(1, 1001)], most=240)
    assert len(curve.steps) <= 240 and curve.steps[-1] == 1000 and curve.values == tuple(map(float, curve.steps))
    assert len(set(b - a for a, b in zip(curve.steps, curve.steps[1:]))) == 1


def test_the_page_is_the_packages_own_files_and_names_no_other_host():
    """No build step and no CDN (#42): the page's ``src``/``href`` are files beside it in the package, and no file
    names a host (the SVG namespace is a name the script passes to ``createElementNS``, never fetched)."""
    static = Path(fleet_view.__file__).parent / "static"
    files = {path.name: path.read_text(encoding="utf-8") for path in static.iterdir()}
    assert set(re.findall(r'(?:src|href)="([^"]+)"', files["index.html"])) <= set(files) - {"index.html"}
    hosts = {m for text in files.values() for m in re.findall(r"\b[a-z]+://[^\s\"'<>]+", text)}
    assert hosts == {"http://www.w3.org/2000/svg"}


def _get(url: str, token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_the_page_is_served_to_anyone_and_its_data_to_the_token_only(tmp_path):
    run_dir = _run(tmp_path, [{"name": "a", "batch_size": 2}])
    _append(run_dir, _row(0, {"a": 2.0}))
    os.makedirs(run_dir.queue / "rejected")
    with start_queue_server(run_dir.queue, run_dir.root) as server:
        status, headers, body = _get(server.url + "/")
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert "connect-src 'self'" in headers["Content-Security-Policy"] and b'src="fleet.js"' in body
        assert _get(server.url + "/fleet.js")[1]["Content-Type"] == "text/javascript; charset=utf-8"
        for token in (None, "wrong"):
            status, _, body = _get(server.url + "/v1/fleet", token)
            assert status == 401 and b"tenant" not in body
        status, headers, body = _get(server.url + "/v1/fleet", server.token)
    assert status == 200 and headers["Cache-Control"] == "no-store"
    fleet = json.loads(body)
    assert fleet["version"] == 1 and fleet["tenants"][0]["loss_curve"] == {"steps": [1], "values": [2.0]}
    assert fleet["queue"] == {"pending": [], "rejected": [], "accepted": []}
