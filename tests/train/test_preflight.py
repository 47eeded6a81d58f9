"""``lorafleet train``'s launcher before any process starts (#25): every place the run writes, the port it
serves, the trackers it logs to and the steps it counts are checked before the run directory is claimed, so
a refusal leaves nothing behind; ``--overwrite`` takes the run's own queue with it. In process: these end
before torchrun starts."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import claim, prepare
from tests.helpers import fleet_harness as h
from tests.helpers.repo import DEMO


@pytest.fixture
def run(tmp_path, tiny_tokenizer_dir):
    """A two-task workload on tiny-llama, a two-replica plan for it, and ``train(*args)``: the CLI's exit code
    for a run into ``tmp_path / "out"``."""
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 2}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128}}\n"
    )
    plan = replace(h.plan_of((1, 1), (1, 1)), tasks=("docsum", "chat"), bucket_boundaries=(256,))
    plan.save(tmp_path / "plan.json")

    def train(*args: str) -> int:
        return main(["train", str(path), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "out"), *args])

    return train, tmp_path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "case",
    ["queue on a file", "queue read-only", "port in use", "steps", "data root", "wandb without a key", "mlflow down"],
)
def test_bad_input_is_one_line_before_the_claim(run, capsys, monkeypatch, case):
    """Each used to fail after the run directory was claimed (plan.json and workload.resolved.yaml left behind,
    so the next fresh run there was refused as used) or, the trackers, in rank 0 after start-up."""
    from tests.helpers.permissions import read_only, unprivileged

    train, tmp = run
    (tmp / "file").write_text("x")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    monkeypatch.setenv("HOME", str(tmp))  # no ~/.netrc, no W&B settings
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL", "NETRC", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:secret@127.0.0.1:{_closed_port()}")
    args, words = {
        "queue on a file": (["--queue", str(tmp / "file")], "file: is a file, expected a directory"),
        "queue read-only": (["--queue", str(read_only(tmp / "ro") / "q")], "cannot write here"),
        "port in use": (["--queue-http", str(busy.getsockname()[1])], "--queue-http: cannot serve on 127.0.0.1"),
        "steps": (["--steps", str(10**13)], "--steps: must be at most 9,223,372,036,854"),
        "data root": (["--queue-data-root", str(tmp / "file")], "--queue-data-root"),
        "wandb without a key": (["--logger", "wandb"], "--logger: wandb: online, and no API key for api.wandb.ai"),
        "mlflow down": (["--logger", "mlflow"], "--logger: mlflow: the tracking server http://127.0.0.1:"),
    }[case]
    try:
        with unprivileged():
            code = train(*args)
    finally:
        busy.close()
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert "secret" not in err  # a tracking URI's credentials are not repeated
    assert not (tmp / "out").exists()  # nothing claimed, nothing written


def _options(tmp: Path, out: str = "out", **kw) -> TrainOptions:
    return TrainOptions(workload=str(tmp / "w.yaml"), plan=str(tmp / "plan.json"), out=str(tmp / out), **kw)


def _used(tmp: Path, queue: Path) -> None:
    """A previous run in ``tmp / "out"`` that left a request in ``queue`` (a finish it never applied), an accepted
    one, and the token file of a server it did not close."""
    (tmp / "out").mkdir(exist_ok=True)
    (tmp / "out" / "metrics.jsonl").write_text("{}\n")
    (queue / "accepted").mkdir(parents=True)
    (queue / "accepted" / "add.yaml").write_text("name: x\n")
    (queue / "finish-chat.yaml").write_text("action: finish\nname: chat\n")
    (queue / ".http.json").write_text('{"url": "http://127.0.0.1:1", "token": "old"}\n')


def test_overwrite_removes_the_runs_own_queue_and_says_so(run, capsys):
    """``--overwrite`` applied the previous run's pending "finish chat" at step 0 of the fresh run (#25): the run
    directory's own queue is the run's, and goes with its files, in one line."""
    _, tmp = run
    queue = tmp / "out" / "queue"
    _used(tmp, queue)
    options = _options(tmp, overwrite=True)
    claim(options, prepare(options)).release()
    assert not queue.exists()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"--overwrite: removed the previous run's queue {queue} (1 request not yet" in out


def test_overwrite_refuses_requests_waiting_in_a_queue_elsewhere(run, capsys):
    """A ``--queue`` outside the run directory is not the run's to remove: its waiting requests are refused in
    one line, before anything of the previous run is removed; its stale token file goes once the run is
    claimed (a fresh run there, pre-staged requests and all, is not refused)."""
    _, tmp = run
    queue = tmp / "shared-queue"
    _used(tmp, queue)
    options = _options(tmp, overwrite=True, queue=str(queue))
    with pytest.raises(InputError, match="holds 1 request\\(s\\) not yet applied \\(finish-chat.yaml\\)"):
        claim(options, prepare(options))
    assert (tmp / "out" / "metrics.jsonl").exists() and (queue / ".http.json").exists()
    fresh = _options(tmp, "fresh", queue=str(queue))
    claim(fresh, prepare(fresh)).release()
    assert (queue / "finish-chat.yaml").exists() and not (queue / ".http.json").exists()


def test_the_data_roots_default_to_the_workloads_data_folders(run):
    from lorafleet.train.preflight import queue_data_roots

    _, tmp = run
    options = _options(tmp)
    assert queue_data_roots(options, prepare(options).workload) == (str(DEMO.resolve()),)
    given = replace(options, queue_data_roots=(str(tmp),))
    assert queue_data_roots(given, prepare(given).workload) == (str(tmp.resolve()),)


def test_the_resolved_workload_names_every_path_absolute(tmp_path, monkeypatch, tiny_tokenizer_dir):
    """``workload.resolved.yaml`` is read from the run directory, so each path the workload names (data,
    tokenizer, a pool's profile) is written absolute, whatever folder the run started in."""
    import yaml

    from lorafleet.train.preflight import save_resolved_workload
    from lorafleet.workload import load_workload
    from tests.helpers.repo import REPO

    (tmp_path / "in" / "profiles").mkdir(parents=True)
    (tmp_path / "in" / "profiles" / "cpu.json").write_bytes((REPO / "profiles" / "tiny-llama-cpu.json").read_bytes())
    (tmp_path / "in" / "docsum.jsonl").write_bytes((DEMO / "docsum.jsonl").read_bytes())
    (tmp_path / "in" / "w.yaml").write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {pools: [{name: measured, gpu: cpu, gpus_per_node: 2, profile: profiles/cpu.json}]}\n"
        "tasks:\n  - {name: docsum, data: {path: docsum.jsonl}, batch_size: 3, context_length: 256}\n"
    )
    monkeypatch.chdir(tmp_path)
    save_resolved_workload(load_workload("in/w.yaml").spec, tmp_path / "resolved.yaml")
    written = yaml.safe_load((tmp_path / "resolved.yaml").read_text())
    assert written["tasks"][0]["data"]["path"] == str(tmp_path / "in" / "docsum.jsonl")
    assert written["cluster"]["pools"][0]["profile"] == str(tmp_path / "in" / "profiles" / "cpu.json")


@pytest.mark.parametrize("how", ["finished and cancelled", "took their steps"])
def test_a_resume_of_a_run_every_task_has_left_is_one_clear_line(run, capsys, how):
    """#38: resuming a run that every task had left (each finished or cancelled through the queue, or done with its
    steps) said "plan.json: tasks: the plan is for tasks [...], the workload has []". It is one line that says
    so, exit 2, before anything is written."""
    from lorafleet.runtime.checkpoint_files import FORMAT_VERSION, MANIFEST, step_dir_name
    from lorafleet.train.queue import Action, Ledger, Request
    from lorafleet.workload import load_workload

    train, tmp = run
    out = tmp / "out"
    step_dir = out / "checkpoints" / step_dir_name(6)
    step_dir.mkdir(parents=True)
    (step_dir / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "step": 6, "files": {}}))
    ledger = Ledger.of(load_workload(str(tmp / "w.yaml")).spec.tasks)
    if how == "finished and cancelled":
        ledger = ledger.apply([Request("f.yaml", Action.FINISH, "docsum")], 4)
        ledger = ledger.apply([Request("c.yaml", Action.CANCEL, "chat")], 6)
    else:
        ledger = ledger.apply([Request("steps", Action.FINISH, name) for name in ("docsum", "chat")], 6)
    ledger.save(out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code = train("--resume", "--steps", "8")
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert err == (
        "lorafleet: error: <args>: --resume: every task of this run has left it (finished or cancelled, the last "
        f"at step 6): nothing to resume; start a new run (the adapters are in {out / 'adapters'})\n"
    ), err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_a_resume_with_a_task_the_workload_file_gained_names_the_queue(run, capsys):
    """#38: a resume whose workload file gained a task ended with exit 0 and the task never trained (the ledger's
    tasks replace the file's, silently). It is one line, exit 2, that names the queue as the way to add it."""
    from lorafleet.runtime.checkpoint_files import FORMAT_VERSION, MANIFEST, step_dir_name
    from lorafleet.train.queue import Action, Ledger, Request
    from lorafleet.workload import load_workload

    train, tmp = run
    out = tmp / "out"
    step_dir = out / "checkpoints" / step_dir_name(4)
    step_dir.mkdir(parents=True)
    (step_dir / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "step": 4, "files": {}}))
    ledger = Ledger.of(load_workload(str(tmp / "w.yaml")).spec.tasks)
    ledger.apply([Request("u.yaml", Action.UPDATE, "chat", changes={"share": 0.5})], 2).save(out)
    workload = tmp / "w.yaml"
    codegen = f"  - {{name: codegen, data: {{path: {DEMO / 'codegen.jsonl'}}}, batch_size: 2, context_length: 256}}\n"
    workload.write_text(workload.read_text() + codegen)
    code = train("--resume", "--steps", "8")
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert f"{workload}: tasks: codegen is not in the run being resumed" in err and "through its queue" in err
