"""The live task queue end to end (``train.queue``, ``train.live``): a run of ``lorafleet train`` takes a
task added at step 3 and a task finished at step 6 through its queue directory, in its running workers (one
launch, no restart), and a malformed request and one naming no task are rejected while it goes on.

Each task's semantics do not depend on the tasks beside it (its stream, its initial adapter and its
updates are its own), so, on the same data, against one reference run of the three tasks with ``codegen``
starting at step 3 (``start_step``, no queue):

- the task that stays (``docsum``) ends equal to the reference's, a run without the changes;
- the finished task (``chat``) is exported at step 6 equal to the reference's checkpoint at step 6;
- the added task (``codegen``) equals the reference's, the task trained for the steps it had (8 - 3)
  from its own start, whatever trained beside it.

And a crash amid the change at step 6 (the ledger written, the plan and ``.apply.json`` not yet settled) is
resumed from the checkpoint of step 6 with the change recorded once.

While the queued run trains, its live page (``--queue-http``'s ``/``) is opened in headless Chromium and shows
``metrics.jsonl``'s numbers as of its read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorafleet.cli import main
from lorafleet.runtime.processes import FAULT_ENV, FAULT_ONCE_ENV
from lorafleet.train.background import GATE_ENV
from lorafleet.train.change_log import ChangeKind, Outcome, read_changes
from lorafleet.train.changes import RELAUNCH_ENV
from tests.helpers.browser import CHROMIUM, Page, rendered_page
from tests.helpers.queue_fleet import CHAT, CODEGEN, DOCSUM, on_four_gpus, workload_file
from tests.helpers.queue_fleet import add_request as _add
from tests.helpers.train_cli import LAUNCHER, _worker_pids

STEPS = 8
ATOL = 1e-5


def _lorafleet(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _train_argv(workload: Path, out: Path, steps: int, *extra: str) -> list[str]:
    plan = workload.with_suffix(".plan.json")
    if not plan.exists():
        assert main(["plan", str(workload), "--json", str(plan)]) == 0
    return ["train", str(workload), "--plan", str(plan), "--steps", str(steps), "--out", str(out), "--no-progress",
            *extra]  # fmt: skip


def _train(workload: Path, out: Path, steps: int, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return _lorafleet(*_train_argv(workload, out, steps, *extra), cwd=out.parent, env=env)


def _train_with_the_page_open(
    workload: Path, out: Path, steps: int, *extra: str, late: tuple[str, dict] | None = None
) -> tuple[subprocess.CompletedProcess, Page | None, list[dict]]:
    """``_train`` with ``--queue-http 0``, the live page opened in headless Chromium while the run trains: the re-plan
    its step-3 change starts is held at a gate (``GATE_ENV``), so the run waits, serving, at the boundary that applies
    the re-plan's answer (its queue read) until the page was read and ``late`` (a request file's name and content) was
    queued; then the gate opens and the run goes on to its end. Returns the run's output, the page (None without
    Chromium) and ``metrics.jsonl``'s rows as read right after the page."""
    gate, logs = out.parent / "page.gate", (out.parent / "train.out", out.parent / "train.err")
    with logs[0].open("w") as stdout, logs[1].open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "lorafleet", *_train_argv(workload, out, steps, *extra,
                                 "--queue-http", "0")], cwd=out.parent, stdout=stdout, stderr=stderr, text=True,
                                env={**os.environ, GATE_ENV: str(gate)})  # fmt: skip
    page, metrics, served = None, out / "metrics.jsonl", out / "queue" / ".http.json"
    try:
        deadline = time.monotonic() + 300  # a bound on a broken run, not a timing
        while not (served.exists() and Path(f"{gate}.waiting").exists()):  # the boundary of step 4 waits
            assert proc.poll() is None and time.monotonic() < deadline, logs[1].read_text()[-2000:]
            time.sleep(0.05)
        if shutil.which(CHROMIUM):
            http = json.loads(served.read_text())
            page = rendered_page(f"{http['url']}/#token={http['token']}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        if late is not None:
            (out / "queue" / late[0]).write_text(json.dumps(late[1]))
    finally:
        gate.touch()
        proc.wait(timeout=600)
    stdout, stderr = (path.read_text() for path in logs)
    assert proc.returncode == 0, stdout + stderr
    return subprocess.CompletedProcess(proc.args, 0, stdout, stderr), page, rows


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


LATE = ("late-update.json", {"action": "update", "name": "codegen", "early_stopping": None})
"""A request queued while the boundary of step 4 waits for its re-plan's answer, its queue read: it changes nothing
of codegen's training (it has no early stopping), and is applied at the next boundary, step 5 (#43)."""


@pytest.fixture(scope="module")
def queued_run(tmp_path_factory, tiny_tokenizer_dir):
    """The run that takes the queued changes, its output, and its live page as read while it trained, with
    ``metrics.jsonl``'s rows as of that read."""
    root = tmp_path_factory.mktemp("queue")
    queued = root / "queued"
    (queued / "queue").mkdir(parents=True)
    _add(queued / "queue", "codegen", batch=2, context=256, at_step=3)
    (queued / "queue" / "finish-chat.json").write_text(json.dumps({"action": "finish", "name": "chat", "at_step": 6}))
    (queued / "queue" / "broken.yaml").write_text("name: [unclosed\n")
    (queued / "queue" / "ghost.yaml").write_text("action: cancel\nname: nobody\n")
    both = workload_file(root / "both.yaml", tiny_tokenizer_dir, [DOCSUM, CHAT])
    log, page, rows = _train_with_the_page_open(both, queued, STEPS, "--checkpoint-every", "4", "--migration-s", "0",
                                                late=LATE)  # fmt: skip
    return queued, log, page, rows


@pytest.fixture(scope="module")
def runs(queued_run, tiny_tokenizer_dir):
    queued, log, _, _ = queued_run
    root = queued.parent
    reference = root / "reference"
    codegen_at_3 = CODEGEN[:-1] + ", start_step: 3}"
    _train(workload_file(root / "all.yaml", tiny_tokenizer_dir, [DOCSUM, CHAT, codegen_at_3]), reference, STEPS,
           "--checkpoint-every", "2")  # fmt: skip
    return queued, reference, reference, log


def test_the_task_that_stays_equals_a_run_without_the_changes(runs):
    queued, reference, _, _ = runs
    assert _max_diff(_adapter(queued / "adapters" / "docsum"), _adapter(reference / "adapters" / "docsum")) < ATOL


def test_the_finished_task_is_exported_as_it_was_at_its_step(runs):
    queued, reference, _, _ = runs
    at_six = reference / "checkpoints" / "step-000006" / "chat"
    assert _max_diff(_adapter(queued / "adapters" / "chat"), _adapter(at_six)) < ATOL
    assert _max_diff(_adapter(queued / "adapters" / "chat"), _adapter(reference / "adapters" / "chat")) > 1e-4


def test_the_added_task_equals_it_trained_alone_from_its_start(runs):
    queued, _, alone, _ = runs
    assert _max_diff(_adapter(queued / "adapters" / "codegen"), _adapter(alone / "adapters" / "codegen")) < ATOL


def test_the_ledger_metrics_and_log_tell_what_happened(runs):
    queued, _, _, log = runs
    ledger = json.loads((queued / "tasks.json").read_text())
    states = {t["spec"]["name"]: (t["state"], t["spec"].get("start_step", 0), t["left"]) for t in ledger["tasks"]}
    assert states == {"docsum": ("active", 0, None), "chat": ("finished", 0, 6), "codegen": ("active", 3, None)}
    rows = [json.loads(line) for line in (queued / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    present = [sorted(r["task_gpu_s"]) for r in rows]
    assert present[2] == ["chat", "docsum"] and present[3] == ["chat", "codegen", "docsum"]
    assert present[6] == ["codegen", "docsum"]
    for r in rows:  # the step's device-seconds, shared out among the tasks it ran
        assert sum(r["task_gpu_s"].values()) == pytest.approx(r["makespan_s"] * 1, rel=1e-6)
    assert "GPU-seconds by task (the whole run): chat" in log.stdout
    assert "step 3: add codegen" in log.stdout and "step 6: finish chat" in log.stdout
    assert "lorafleet train: queue: http://127.0.0.1:" in log.stdout  # served for the whole run, then closed
    assert not (queued / "queue" / ".http.json").exists()
    assert [(a["step"], a["action"], a["name"]) for a in ledger["applied"]] == [
        (3, "add", "codegen"),
        (5, "update", "codegen"),
        (6, "finish", "chat"),
    ]


def test_the_live_page_shows_the_training_fleets_numbers_in_a_browser(queued_run):
    """The page read while the run trained (held at a boundary mid-run): the run's steps, mean step and ETA, and each
    tenant's state, steps, last loss, loss curve, GPU-seconds and (docsum's, of its own 8 steps) ETA are
    ``metrics.jsonl``'s rows up to the steps the page shows, to the last digit of its ``data-value``s."""
    _, _, page, rows = queued_run
    if page is None:
        pytest.skip("no chromium on this machine: `make setup` installs Debian's package")
    assert page.one(id="status").attrs["data-state"] == "ok"
    run = page.one(id="run")
    done = int(page.one(data_field="steps-done", within=run).attrs["data-value"])
    assert 0 < done < STEPS and len(rows) >= done  # mid-run
    rows = rows[:done]
    recent = [r["makespan_s"] for r in rows[-20:]]
    mean = sum(recent) / len(recent)
    assert float(page.one(data_field="mean-step", within=run).attrs["data-value"]) == pytest.approx(mean, rel=1e-12)
    assert float(page.one(data_field="eta", within=run).attrs["data-value"]) == pytest.approx(mean * (STEPS - done))
    trained = [task for task in ("docsum", "chat", "codegen") if any(task in r["losses"] for r in rows)]
    assert trained[:2] == ["docsum", "chat"]
    for task in trained:
        cells = {e.attrs["data-field"]: e for e in page.find(within=page.one("tr", data_tenant=task))
                 if "data-field" in e.attrs}  # fmt: skip
        losses = [(r["step"] + 1, r["losses"][task]) for r in rows if task in r["losses"]]
        assert cells["state"].text == "training"
        assert int(cells["steps-done"].attrs["data-value"]) == len(losses)
        assert float(cells["loss"].attrs["data-value"]) == losses[-1][1]
        gpu_s = sum(r["task_gpu_s"].get(task, 0) for r in rows)
        assert float(cells["gpu-s"].attrs["data-value"]) == pytest.approx(gpu_s, rel=1e-12)
        curve = page.one(within=page.one("div", data_tenant=task), data_field="loss-curve")
        assert [int(s) for s in curve.attrs["data-steps"].split(",")] == [s for s, _ in losses]
        assert [float(v) for v in curve.attrs["data-values"].split(",")] == [v for _, v in losses]
        if task == "docsum":
            assert float(cells["eta"].attrs["data-value"]) == pytest.approx(mean * (STEPS - len(losses)), rel=1e-12)


def test_the_changes_are_applied_in_the_running_workers(runs):
    """One launch of the workers for the whole run: every change applied in place, every stage kept, each join's or
    leave's re-plan answered beside the steps a step later (``changes.jsonl``). The update queued while the boundary
    of step 4 waited for that answer is applied at the next boundary, step 5, not as a second change at step 4 (#43:
    a boundary reads the queue once, when the loop reaches it)."""
    queued, _, _, log = runs
    assert log.stdout.count("starting 1 worker process") == 1 and log.stdout.count("process group up") == 1
    rows = read_changes(queued / "changes.jsonl")
    assert [(r.step, r.kind, r.outcome) for r in rows] == [
        (3, ChangeKind.CHANGE, Outcome.KEPT_REPLANNING),
        (4, ChangeKind.REPLAN, Outcome.KEPT),
        (5, ChangeKind.CHANGE, Outcome.KEPT),
        (6, ChangeKind.CHANGE, Outcome.KEPT_REPLANNING),
        (7, ChangeKind.REPLAN, Outcome.KEPT),
    ]
    changes = [r for r in rows if r.kind is ChangeKind.CHANGE]
    assert [[(q.action.value, q.name) for q in r.requests] for r in changes] == [
        [("add", "codegen")],
        [("update", "codegen")],
        [("finish", "chat")],
    ]
    assert all(r.seconds > 0 and r.rebuilt == () for r in changes)  # applied in place, every stage kept
    assert [r.tasks for r in changes] == [("docsum", "chat", "codegen")] * 2 + [("docsum", "codegen")]
    assert not (queued / "queue" / ".apply.json").exists()


def _queue_the_changes(out: Path) -> None:
    """The queued run's two requests: ``codegen`` added at step 3, ``chat`` finished at step 6."""
    (out / "queue").mkdir(parents=True)
    _add(out / "queue", "codegen", batch=2, context=256, at_step=3)
    (out / "queue" / "finish-chat.json").write_text(json.dumps({"action": "finish", "name": "chat", "at_step": 6}))


def _ends_as_the_queued_run(out: Path, queued: Path, changes: tuple[int, ...] = (3, 6)) -> None:
    """Every step trained once, each change (at ``changes``) recorded once, nothing left in flight, every adapter
    the uninterrupted run's."""
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(STEPS))
    applied = [(a["step"], a["action"], a["name"]) for a in json.loads((out / "tasks.json").read_text())["applied"]]
    assert applied[:2] == [(3, "add", "codegen"), (6, "finish", "chat")]
    rows = [r for r in read_changes(out / "changes.jsonl") if r.kind is ChangeKind.CHANGE]
    assert tuple(r.step for r in rows) == changes, rows
    assert not (out / "queue" / ".apply.json").exists()
    for task in ("docsum", "codegen", "chat"):
        assert _max_diff(_adapter(out / "adapters" / task), _adapter(queued / "adapters" / task)) < ATOL, task


def test_a_crash_amid_a_change_is_finished_once_by_the_restart(runs, tmp_path):
    """#38's fault matrix, one case of it end to end (``benchmarks/soak_changes.py`` runs it whole; every phase of a
    change is crashed at component level in ``tests/train/test_inflight.py``): rank 0 is killed once chat's adapter
    is exported at step 6 and before the fleet changed (``runtime.processes.FAULT_ENV``, once), torchrun restarts the
    workers, and the restart does the finish again from the checkpoint before it (``train.inflight``): the run ends
    as the uninterrupted one, chat trained no step after 6."""
    queued, _, _, _ = runs
    out = tmp_path / "faulted"
    _queue_the_changes(out)
    env = {FAULT_ENV: "exported@6", FAULT_ONCE_ENV: str(tmp_path / "fault.once")}
    log = _train(queued.parent / "both.yaml", out, STEPS, "--checkpoint-every", "4", "--migration-s", "0",
                 "--max-restarts", "1", env=env)  # fmt: skip
    assert (tmp_path / "fault.once").exists() and "restart 1 of 1" in log.stdout, log.stdout
    _ends_as_the_queued_run(out, queued)


def _crashed(workload: Path, out: Path, fault: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The queued run's changes, trained without restarts with rank 0 killed once at ``fault``: the run stopped."""
    _queue_the_changes(out)
    env = {FAULT_ENV: fault, FAULT_ONCE_ENV: str(tmp_path / "fault.once")}
    argv = ["train", str(workload), "--plan", str(workload.with_suffix(".plan.json")), "--steps", str(STEPS),
            "--out", str(out), "--no-progress", "--checkpoint-every", "4", "--migration-s", "0"]  # fmt: skip
    crashed = subprocess.run([sys.executable, "-m", "lorafleet", *argv], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600, env={**os.environ, **env})  # fmt: skip
    assert crashed.returncode != 0 and (tmp_path / "fault.once").exists(), crashed.stderr[-2000:]
    return crashed


def test_a_change_in_flight_is_finished_by_a_resume(runs, tmp_path):
    """Without restarts: rank 0 is killed once the add of codegen at step 3 is applied in place, before any checkpoint
    has committed (the first would be at step 4); the launcher says to continue with --resume. ``--resume`` starts
    again from step 0 with what the run recorded (its queue, the change in flight: soak_changes found it refusing
    here, "nothing to resume", the add lost), does the add again at its step from its record, and ends as the
    uninterrupted run. On the way, every change is handed to the launcher (``LORAFLEET_RELAUNCH_CHANGES``, forced:
    the add again at 3, the finish at 6, a share at 7), which restarts the workers each time, and no step is lost."""
    queued, _, _, _ = runs
    out = tmp_path / "crashed"
    workload = queued.parent / "both.yaml"
    crashed = _crashed(workload, out, "applied@3", tmp_path)
    assert (out / "queue" / ".apply.json").exists() and not list((out / "checkpoints").glob("step-*"))
    assert "continue with --resume" in crashed.stderr, crashed.stderr[-2000:]
    (out / "queue" / "share.yaml").write_text("action: update\nname: docsum\nshare: 1.0\nat_step: 7\n")
    log = _train(workload, out, STEPS, "--resume", "--checkpoint-every", "4", "--migration-s", "0",
                 env={RELAUNCH_ENV: "1"})  # fmt: skip
    for step in (3, 6, 7):  # the add done again at its step, the finish, then the share, each through the launcher
        assert f"step {step}: {RELAUNCH_ENV} is set: the workers restart to apply the changes" in log.stdout
    assert log.stdout.count("starting 1 worker process") == 4 and "Warning" not in log.stderr, log.stderr
    _ends_as_the_queued_run(out, queued, changes=(3, 6, 7))


@pytest.mark.slow
def test_a_crash_while_the_replan_runs_resumes_it_and_applies_it_at_its_step(runs, tmp_path):
    """``codegen`` joins at step 3 on the kept deployment and its re-plan runs beside the steps, due at step 6
    (``--replan-after 3``). The re-plan is held at a gate (``train.background.GATE_ENV``), so the run cannot pass
    step 6 until the test opens it: the worker is SIGKILLed once the change is committed (``.replan.json``
    written, a checkpoint after it), whenever that is; the gate opens; torchrun restarts the worker, the run
    resumes from that checkpoint, runs the re-plan again and applies its answer at step 6, once; every task ends
    as in the reference run."""
    queued, reference, _, _ = runs
    out = tmp_path / "killed"
    (out / "queue").mkdir(parents=True)
    _add(out / "queue", "codegen", batch=2, context=256, at_step=3)
    workload = queued.parent / "both.yaml"
    argv = [*LAUNCHER, "train", str(workload), "--plan", str(workload.with_suffix(".plan.json")), "--steps",
            str(STEPS), "--out", str(out), "--no-progress", "--checkpoint-every", "4", "--replan-after", "3",
            "--max-restarts", "1"]  # fmt: skip
    gate = tmp_path / "replan-gate"
    env = {**os.environ, GATE_ENV: str(gate)}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    deadline = time.monotonic() + 300
    replan, checkpoints = out / "queue" / ".replan.json", out / "checkpoints"
    while not (replan.exists() and {p.name for p in checkpoints.glob("step-*")} & {"step-000003", "step-000004"}):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    (pid,) = _worker_pids(str(out))
    os.kill(pid, signal.SIGKILL)
    gate.touch()
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "restart 1 of 1" in stdout and "the re-plan of step 3 runs again beside the steps to step 6" in stdout
    replans = [r for r in read_changes(out / "changes.jsonl") if r.kind is ChangeKind.REPLAN]
    assert [(r.step, r.replanned_for) for r in replans] == [(6, 3)], stdout
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(STEPS))
    assert json.loads((out / "tasks.json").read_text())["applied"] == [
        {"step": 3, "file": "add-codegen.yaml", "action": "add", "name": "codegen"}
    ]
    assert not replan.exists()
    for task in ("docsum", "chat", "codegen"):
        assert _max_diff(_adapter(out / "adapters" / task), _adapter(reference / "adapters" / task)) < ATOL, task


def test_bad_requests_are_rejected_with_one_line_and_the_run_goes_on(runs):
    queued, _, _, log = runs
    rejected = queued / "queue" / "rejected"
    assert sorted(p.name for p in rejected.iterdir()) == [
        "broken.yaml",
        "broken.yaml.reason",
        "ghost.yaml",
        "ghost.yaml.reason",
    ]
    assert "malformed YAML" in (rejected / "broken.yaml.reason").read_text()
    assert "no active task 'nobody'" in (rejected / "ghost.yaml.reason").read_text()
    lines = [line for line in log.stderr.splitlines() if "queue: rejected" in line]
    assert len(lines) == 2 and all(line.startswith("lorafleet train: queue: rejected ") for line in lines)
    accepted = sorted(p.name for p in (queued / "queue" / "accepted").iterdir())
    assert accepted == ["add-codegen.yaml", "finish-chat.json", LATE[0]]


@pytest.mark.slow
def test_the_fleet_moves_in_place_after_its_background_replan_and_when_no_replica_holds_a_task(
    tmp_path, tiny_tokenizer_dir
):
    """Two moves in the running workers of 4 ranks, under the default policy (recalibration on: every other
    queue test runs with it too but keeps its deployment), by the GPU-seconds objective with free migration:

    - ``codegen`` joins at step 3: the two ``<1,1>`` replicas (ranks 0 and 3) serve it, so the change is applied
      on them at once and the re-plan runs beside step 3 (``train.background``); its answer, due at step 4,
      drops a replica (one ``<1,1>`` costs fewer GPU-seconds a step), and the rank left idle stops comparing
      adapter shards it no longer has (its moved-check failed the next step: a zip of unequal lengths);
    - ``moddoc``'s 1,536-token documents fit no ``<1,1>`` replica of 48 MiB, so its add at step 5 re-plans at
      the boundary to a ``<2,1>`` and builds the new stages in place; the recalibrator moves with the deployment
      (its remap of the checkpoint state failed on #29's pools, a KeyError or an AttributeError).

    torchrun says nothing of its own on the way (its log lines are quiet under the launcher)."""
    path, profile = on_four_gpus(tmp_path, tiny_tokenizer_dir, slots=(0, 3))
    out = tmp_path / "out"
    (out / "queue").mkdir(parents=True)
    _add(out / "queue", "codegen", batch=2, context=256, at_step=3)
    _add(out / "queue", "moddoc", batch=1, context=1536, at_step=5)
    log = _train(path, out, 7, "--profile", str(profile), "--checkpoint-every", "100", "--replan-objective", "gpu-s",
                 "--migration-s", "0")  # fmt: skip
    rows = read_changes(out / "changes.jsonl")
    assert [(r.step, r.kind, r.outcome, r.plan) for r in rows[:2]] == [
        (3, ChangeKind.CHANGE, Outcome.KEPT_REPLANNING, "<1,1> x 2"),
        (4, ChangeKind.REPLAN, Outcome.MOVED, "<1,1> x 1"),
    ], log.stdout
    assert rows[0].replan_at == 4 and rows[1].replanned_for == 3 and rows[1].seconds > 0
    (moddoc,) = rows[2:]
    assert (moddoc.step, moddoc.outcome) == (5, Outcome.MOVED) and moddoc.note.startswith("re-planned to ")
    assert moddoc.rebuilt  # ranks built their stages in place
    assert log.stdout.count("process group up") == 1 and "torch/distributed" not in log.stderr, log.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7)) and "moddoc" in rows[6]["task_gpu_s"]
    assert [len(r["correction"]) for r in rows] == [2] * 4 + [1] * 3  # 2 replicas, then 1 from step 4
    assert not (out / "queue" / ".replan.json").exists()


def test_a_change_whose_plan_needs_more_processes_restarts_the_workers_at_its_step(tmp_path, tiny_tokenizer_dir):
    """The hand-off to the launcher: one ``<1,1>`` replica (one process) on 4 GPUs, and ``moddoc`` joins at step
    3, whose 1,536-token documents fit no ``<1,1>`` of 48 MiB. The boundary re-plans to a deployment of more
    GPU slots than the run has processes, so the workers stop at the committed checkpoint of step 3 with the
    change pending; the launcher re-plans and relaunches them once, and the run goes on to its end: every step
    trained once, the added task from step 3, nothing pending left in the queue."""
    path, profile = on_four_gpus(tmp_path, tiny_tokenizer_dir, slots=(0,))
    out = tmp_path / "out"
    (out / "queue").mkdir(parents=True)
    _add(out / "queue", "moddoc", batch=1, context=1536, at_step=3)
    log = _train(path, out, 6, "--profile", str(profile), "--checkpoint-every", "100", "--migration-s", "0")
    rows = read_changes(out / "changes.jsonl")
    assert [(r.step, r.outcome, r.tasks) for r in rows] == [
        (3, Outcome.HANDED_OFF, ("docsum", "chat", "moddoc")),
        (3, Outcome.RELAUNCHED, ("docsum", "chat", "moddoc")),
    ], log.stdout
    assert rows[0].plan == rows[1].plan and rows[0].note.startswith("re-planned to ")
    assert log.stdout.count("process group up") == 2, log.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert ["moddoc" in r["task_gpu_s"] for r in rows] == [False] * 3 + [True] * 3
    assert not (out / "queue" / ".apply.json").exists() and not (out / "queue" / ".replan.json").exists()
