"""``lorafleet train --logger``: the step scalars reach Weights & Biases (offline) and MLflow (a file
store) under TensorBoard's tags, a resumed launch continues the tracker's run, and a logger that is
unknown or not installed is refused before anything starts."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from lorafleet.errors import InputError
from lorafleet.metrics import MlflowWriter, WandbWriter, experiment_logger, step_scalars
from lorafleet.plans import StepReport
from lorafleet.train.options import check_loggers

REPORTS = tuple(
    StepReport(
        step=i,
        replica_busy_s=(1.0, 0.5 + i),
        makespan_s=1.0 + i,
        task_tokens={"docsum": 300, "chat": 200},
        losses={"docsum": 2.5 - i / 10, "chat": 3.0},
        estimated_makespan_s=1.0,
    )
    for i in range(3)
)
CONFIG = {"plan": "<1,1> x 2", "gpus": 2}
EVALUATED = {
    "eval_loss": {"chat": 1.75, "docsum": 2.25},
    "eval_token_accuracy": {"chat": 0.5, "docsum": 0.25},
    "eval_gpu_s": {"chat": 0.125, "docsum": 0.375},
    "eval_s": 0.5,
    "eval_predicted_s": 0.625,
}
"""The ``extra`` of a step an evaluation followed (``train.evaluation``): each task's eval loss, token accuracy
and GPU-seconds, the pass's measured and predicted seconds."""
EVAL_TAGS = {
    "eval_loss/chat": 1.75,
    "eval_loss/docsum": 2.25,
    "eval_token_accuracy/chat": 0.5,
    "eval_gpu_s/docsum": 0.375,
    "eval/seconds": 0.5,
    "eval/predicted_s": 0.625,
}


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file: LevelDB's log format (32 KiB blocks of
    ``checksum:4 length:2 type:1 data`` chunks; FULL=1, FIRST=2, MIDDLE=3, LAST=4) after W&B's
    7-byte header."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    records, chunks, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:
            break
        chunks += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _wandb_history(out: Path) -> tuple[set[str], dict[str, list[tuple[int, float]]]]:
    """The run ids and each scalar's (step, value) of every offline W&B run under ``out/wandb``."""
    import json

    ids, history = set(), {}
    for file in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = record.history.item
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
                for key, value in row.items():
                    if not key.startswith("_"):
                        history.setdefault(key, []).append((row["_step"], value))
    return ids, history


def _settled_history(out: Path, runs: int = 1, key: str = "", steps: int = 0, wait_s: float = 60.0):
    """:func:`_wandb_history` once ``runs`` run files are there and ``key`` has ``steps`` rows: W&B's service
    process (``wandb-core``) writes the run file, and on a loaded machine its last records can land just
    after ``finish`` returns."""
    deadline = time.monotonic() + wait_s
    while True:
        ids, history = _wandb_history(out)
        settled = len(ids) >= runs and len(history.get(key, ())) >= steps
        if settled or time.monotonic() > deadline:
            return ids, history
        time.sleep(0.2)


@pytest.fixture
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def test_wandb_offline_logs_every_scalar_and_a_resume_continues_the_run(tmp_path, offline_wandb):
    out = tmp_path / "run"
    first = experiment_logger("wandb", out, CONFIG)
    assert isinstance(first, WandbWriter)
    for report in REPORTS[:2]:
        evaluated = EVALUATED if report.step == 1 else {}
        first.write(report, tokens_per_s=400.0, task_gpu_s={"docsum": 1.5, "chat": 0.5}, **evaluated)
    first.close()
    again = experiment_logger("wandb", out, CONFIG, resume=True)
    again.write(REPORTS[2], tokens_per_s=400.0)
    again.close()

    ids, history = _settled_history(out, key="loss/docsum", steps=3)
    assert ids == {(out / ".wandb-run-id").read_text().strip()}  # one run across both launches
    assert history["loss/docsum"] == [(0, 2.5), (1, 2.4), (2, 2.3)]
    assert history["makespan/measured_s"] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert history["gpu_s/docsum"] == [(0, 1.5), (1, 1.5)]
    assert set(step_scalars(REPORTS[0], tokens_per_s=400.0)) <= set(history)
    assert {tag: history[tag] for tag in EVAL_TAGS} == {tag: [(1, value)] for tag, value in EVAL_TAGS.items()}


def test_a_fresh_launch_starts_a_new_wandb_run(tmp_path, offline_wandb):
    out = tmp_path / "run"
    for _ in range(2):
        writer = experiment_logger("wandb", out, CONFIG)
        writer.write(REPORTS[0])
        writer.close()
    ids, _ = _settled_history(out, runs=2)
    assert len(ids) == 2


def test_mlflow_file_store_logs_params_and_scalars_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    out = tmp_path / "run"
    first = experiment_logger("mlflow", out, CONFIG)
    assert isinstance(first, MlflowWriter) and first.tracking_uri == (out / "mlruns").resolve().as_uri()
    for report in REPORTS[:2]:
        first.write(report, task_gpu_s={"docsum": 1.5, "chat": 0.5}, **(EVALUATED if report.step == 1 else {}))
    first.close()
    again = experiment_logger("mlflow", out, CONFIG, resume=True)
    again.write(REPORTS[2])
    again.close()

    assert again.run_id == first.run_id
    client = MlflowClient(tracking_uri=first.tracking_uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params == {"plan": "<1,1> x 2", "gpus": "2"}
    assert client.get_experiment(run.info.experiment_id).name == "lorafleet"
    history = [(m.step, m.value) for m in client.get_metric_history(first.run_id, "loss/docsum")]
    assert history == [(0, 2.5), (1, 2.4), (2, 2.3)]
    assert [m.value for m in client.get_metric_history(first.run_id, "gpu_s/docsum")] == [1.5, 1.5]
    for tag, value in EVAL_TAGS.items():  # an evaluation's scalars, at the step it followed
        assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, tag)] == [(1, value)], tag


def test_an_unknown_or_missing_logger_is_refused_up_front(monkeypatch):
    check_loggers(("wandb", "mlflow"))
    with pytest.raises(InputError, match="--logger: expected one of wandb, mlflow, got 'comet'"):
        check_loggers(("comet",))
    monkeypatch.setattr("lorafleet.train.options.find_spec", lambda name: None)
    with pytest.raises(InputError, match=r"the mlflow package is not installed \(pip install 'lorafleet\[mlflow\]'\)"):
        check_loggers(("mlflow",))


def test_what_would_stop_a_tracker_starting_is_found_offline(tmp_path):
    """The launcher's up-front checks (``start_problem``, #25): W&B needs an API key only online, and finds one in
    the environment or ``wandb login``'s netrc; MLflow's tracking server must accept a connection."""
    import socket

    from lorafleet.metrics.trackers import MlflowWriter, WandbWriter

    home = {"WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_DIR": str(tmp_path), "NETRC": str(tmp_path / "n")}
    assert "no API key for api.wandb.ai" in WandbWriter.start_problem(home)
    assert "no API key for w.example" in WandbWriter.start_problem({**home, "WANDB_BASE_URL": "https://w.example"})
    assert WandbWriter.start_problem({**home, "WANDB_MODE": "offline"}) is None
    assert WandbWriter.start_problem({**home, "WANDB_API_KEY": "k"}) is None
    (tmp_path / "n").write_text("machine api.wandb.ai login user password k\n")
    assert WandbWriter.start_problem(home) is None
    (tmp_path / "n").unlink()
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = offline\n")  # what `wandb offline` writes
    assert WandbWriter.start_problem(home) is None

    assert MlflowWriter.start_problem({}) is None
    assert MlflowWriter.start_problem({"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri()}) is None
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert MlflowWriter.start_problem({"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}) is None
    refused = MlflowWriter.start_problem({"MLFLOW_TRACKING_URI": f"https://u:pw@127.0.0.1:{port}/x"})
    assert refused.startswith(f"the tracking server https://127.0.0.1:{port} (MLFLOW_TRACKING_URI) does not answer")
    assert "pw" not in refused
