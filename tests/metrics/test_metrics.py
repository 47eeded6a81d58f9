"""Metrics writers: the CSV twin of the JSONL, TensorBoard scalars, the fan-out, the progress bar."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from lorafleet.metrics import CsvWriter, FanOut, JsonlWriter, LogLines, ProgressBar, TensorBoardWriter, summarize
from lorafleet.plans import StepReport

REPORTS = (
    StepReport(
        step=0,
        replica_busy_s=(1.0, 0.5),
        makespan_s=1.25,
        task_tokens={"docsum": 300, "chat": 200},
        task_padding_tokens={"docsum": 10, "chat": 0},
        losses={"docsum": 2.5, "chat": 3.0},
        estimated_makespan_s=1.0,
        dispatch_solve_s=0.01,
    ),
    StepReport(
        step=1,
        replica_busy_s=(0.8, 0.9),
        makespan_s=1.0,
        task_tokens={"docsum": 250, "chat": 150},
        task_padding_tokens={"docsum": 5, "chat": 2},
        losses={"docsum": 2.0, "chat": 2.75},
        estimated_makespan_s=0.8,
        dispatch_solve_s=0.02,
        failed_replicas=(1,),
    ),
)
PREDICTED = ((0.9, 0.6), (0.8, 0.6))
TASK_GPU_S = ({"docsum": 1.5, "chat": 1.0}, {"docsum": 1.25, "chat": 0.75})
"""What each task owes per step (``lorafleet.accounting.task_gpu_seconds``): sums to makespan x 2 GPUs."""


def _write_all(writer) -> None:
    for report, predicted, owed in zip(REPORTS, PREDICTED, TASK_GPU_S):
        writer.write(
            report,
            tokens_per_s=sum(report.task_tokens.values()) / report.makespan_s,
            predicted_busy_s=predicted,
            task_gpu_s=owed,
        )


def test_csv_has_one_flat_row_per_report_and_appends_under_its_header(tmp_path):
    path = tmp_path / "m" / "metrics.csv"
    with CsvWriter(path) as writer:
        _write_all(writer)
    rows = list(csv.DictReader(path.open()))
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert float(rows[0]["loss/docsum"]) == 2.5 and float(rows[1]["loss/chat"]) == 2.75
    assert float(rows[0]["tokens_per_s"]) == 400.0 and int(rows[1]["tokens"]) == 400
    assert float(rows[0]["busy_s/1"]) == 0.5 and float(rows[0]["idle_s/1"]) == 0.75
    assert float(rows[1]["predicted_busy_s/1"]) == 0.6
    assert float(rows[0]["makespan_ratio"]) == 1.25 and float(rows[1]["dispatch_solve_s"]) == 0.02
    assert rows[0]["failed_replicas"] == "" and rows[1]["failed_replicas"] == "1"
    assert float(rows[0]["gpu_s/docsum"]) == 1.5 and float(rows[1]["gpu_s/chat"]) == 0.75
    with CsvWriter(path) as writer:  # a resumed run appends rows, not a second header
        writer.write(REPORTS[0])
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("step,")
    assert list(csv.DictReader(path.open()))[2]["predicted_busy_s/0"] == ""


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardWriter(tmp_path / "tb") as writer:
        _write_all(writer)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss/docsum",
        "loss/chat",
        "throughput/tokens_per_s",
        "makespan/measured_s",
        "makespan/estimated_s",
        "makespan/measured_over_estimated",
        "dispatch/solve_s",
        "busy/replica_0",
        "busy/replica_1",
        "busy_predicted/replica_1",
        "busy_ratio/replica_1",
        "gpu_s/docsum",
        "gpu_s/chat",
    } <= tags
    assert [e.value for e in events.Scalars("gpu_s/chat")] == pytest.approx([1.0, 0.75])
    loss = events.Scalars("loss/docsum")
    assert [e.step for e in loss] == [0, 1]
    assert [e.value for e in loss] == pytest.approx([2.5, 2.0])
    assert [e.value for e in events.Scalars("busy_ratio/replica_1")] == pytest.approx([0.5 / 0.6, 0.9 / 0.6])
    assert [e.value for e in events.Scalars("throughput/tokens_per_s")] == pytest.approx([400.0, 400.0])


def test_fan_out_writes_to_every_writer_and_closes_them_all(tmp_path):
    class Broken:
        closed = False

        def write(self, report, **extra):
            pass

        def close(self):
            Broken.closed = True
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        with FanOut(Broken(), JsonlWriter(tmp_path / "m.jsonl"), CsvWriter(tmp_path / "m.csv")) as writer:
            _write_all(writer)
    assert Broken.closed
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and records[1]["predicted_busy_s"] == [0.8, 0.6]
    assert records[1]["task_gpu_s"] == {"docsum": 1.25, "chat": 0.75}
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 3


def test_progress_bar_shows_step_makespan_loss_and_throughput():
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    bar = ProgressBar(total=5, console=console)
    _write_all(bar)
    bar.close()
    text = console.file.getvalue()
    assert "2/5" in text and "step 1.00s (predicted 0.80s)" in text and "loss 2.3750" in text and "400 tok/s" in text
    assert "ETA 0m03s" in text  # a mean 1.125 s a step, 3 left: from the reports, not rich's wall-clock rate


def test_eta_reads_minutes_then_hours():
    from lorafleet.metrics import format_eta

    assert [format_eta(s) for s in (0, 59.4, 61, 3599, 3600, 7620, float("nan"))] == [
        "0m00s",
        "0m59s",
        "1m01s",
        "59m59s",
        "1h00m",
        "2h07m",
        "--",
    ]


def test_log_lines_give_step_losses_times_and_eta():
    lines = []
    log = LogLines(total=4, print_fn=lines.append)
    _write_all(log)
    assert lines[0].startswith("step 1/4  loss docsum")
    assert "step 1.25 s (predicted 1 s)" in lines[0] and lines[0].endswith("ETA 0m04s")  # 1.25 s x 3 left
    assert lines[1].endswith("ETA 0m02s")  # mean 1.125 s a step, 2 left


def test_ratio_without_a_prediction_is_nan(tmp_path):
    with CsvWriter(tmp_path / "m.csv") as writer:
        writer.write(StepReport(step=0, replica_busy_s=(1.0,), makespan_s=1.0))
    assert math.isnan(float(next(csv.DictReader((tmp_path / "m.csv").open()))["makespan_ratio"]))


def _owed(step: int, **owed: float) -> StepReport:
    return StepReport(step=step, replica_busy_s=(1.0,), makespan_s=1.0, task_tokens=dict.fromkeys(owed, 10))


def test_csv_gains_the_column_of_a_task_that_joins_later(tmp_path):
    """A task first seen at step 2: the header is extended once (its column beside the other
    ``gpu_s/`` ones), the earlier rows empty in it; a resumed run's new task likewise."""
    path = tmp_path / "metrics.csv"
    with CsvWriter(path) as writer:
        writer.write(_owed(0, chat=1.0), task_gpu_s={"chat": 1.0})
        writer.write(_owed(1, chat=1.0), task_gpu_s={"chat": 1.0})
        writer.write(_owed(2, chat=0.25, docs=0.75), task_gpu_s={"chat": 0.25, "docs": 0.75})
        writer.write(_owed(3, chat=0.5, docs=0.5), task_gpu_s={"chat": 0.5, "docs": 0.5})
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and sum(line.startswith("step,") for line in lines) == 1
    header = lines[0].split(",")
    assert header.index("gpu_s/docs") == header.index("gpu_s/chat") + 1
    assert header.index("tokens/docs") == header.index("tokens/chat") + 1
    rows = list(csv.DictReader(path.open()))
    assert [r["gpu_s/docs"] for r in rows] == ["", "", "0.75", "0.5"]
    assert [r["gpu_s/chat"] for r in rows] == ["1.0", "1.0", "0.25", "0.5"]
    assert [r["tokens/docs"] for r in rows] == ["", "", "10", "10"]
    with CsvWriter(path) as writer:  # resumed with a third task
        writer.write(_owed(4, chat=1.0, code=0.0), task_gpu_s={"chat": 1.0, "code": 0.0})
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r["gpu_s/code"] for r in rows] == ["", "", "", "", "0.0"] and rows[4]["gpu_s/docs"] == ""
    assert not list(tmp_path.glob("*.tmp"))


def test_summary_totals_gpu_seconds_per_task():
    summary = summarize(REPORTS, 2, task_gpu_s=TASK_GPU_S)
    assert summary.task_gpu_seconds == pytest.approx({"docsum": 2.75, "chat": 1.75})
    assert sum(summary.task_gpu_seconds.values()) == pytest.approx(summary.gpu_seconds)
    assert summarize(REPORTS, 2).task_gpu_seconds == {}
    with pytest.raises(ValueError, match="1 steps, 2 step reports"):
        summarize(REPORTS, 2, task_gpu_s=TASK_GPU_S[:1])


def test_phases_count_in_words():
    from lorafleet.train.phases import counted

    assert [counted(1, "GPU"), counted(8, "GPU"), counted(1, "rank"), counted(2, "process", "processes")] == [
        "1 GPU",
        "8 GPUs",
        "1 rank",
        "2 processes",
    ]


def test_a_jsonl_row_reads_back_as_its_report_and_the_rows_summarise_as_the_reports(tmp_path):
    from lorafleet.metrics import read_rows, step_report, summarize_rows

    with JsonlWriter(tmp_path / "metrics.jsonl") as writer:
        _write_all(writer)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [step_report(row) for row in rows] == list(REPORTS)
    from_rows, from_reports = summarize_rows(rows), summarize(REPORTS, 2, task_gpu_s=TASK_GPU_S)
    assert from_rows.steps == 2 and list(from_rows.makespan_s) == list(from_reports.makespan_s)
    assert from_rows.mean_estimated_makespan_s == pytest.approx(0.9)
    assert from_rows.task_gpu_seconds == from_reports.task_gpu_seconds
    assert from_rows.padding_ratio == from_reports.padding_ratio and from_rows.failures == 1
    assert math.isnan(from_rows.gpu_seconds) and math.isnan(from_rows.utilisation)  # the rows do not say the GPUs
    assert from_reports.utilisation == pytest.approx((1.0 + 0.5 + 0.8 + 0.9) / (2 * (1.25 + 1.0)))
    assert read_rows(tmp_path / "none.jsonl") == []


def test_an_evaluation_reaches_every_sink_a_loss_does(tmp_path):
    """The row of a step an evaluation followed (``train.evaluation``): its numbers in the JSONL, as CSV columns that
    appear when it first does, as scalars (TensorBoard, W&B, MLflow), and as a console line."""
    from lorafleet.metrics.records import step_scalars

    evaluation = {"eval_loss": {"chat": 1.5}, "eval_token_accuracy": {"chat": 0.25}, "eval_gpu_s": {"chat": 0.5},
                  "eval_s": 0.25, "eval_predicted_s": 0.3}  # fmt: skip
    scalars = step_scalars(REPORTS[1], **evaluation)
    assert {k: scalars[k] for k in scalars if k.startswith("eval")} == {
        "eval_loss/chat": 1.5, "eval_token_accuracy/chat": 0.25, "eval_gpu_s/chat": 0.5,
        "eval/seconds": 0.25, "eval/predicted_s": 0.3,
    }  # fmt: skip
    assert not any(k.startswith("eval") for k in step_scalars(REPORTS[0]))
    with CsvWriter(tmp_path / "m.csv") as csv_writer, JsonlWriter(tmp_path / "m.jsonl") as jsonl:
        for writer in (csv_writer, jsonl):
            writer.write(REPORTS[0])
            writer.write(REPORTS[1], **evaluation)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "m.csv").read_text())))
    assert (rows[0]["eval_loss/chat"], rows[1]["eval_loss/chat"]) == ("", "1.5")
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[1])["eval_token_accuracy"] == {"chat": 0.25}
    lines = []
    LogLines(total=4, print_fn=lines.append).write(REPORTS[1], **evaluation)
    assert lines[1] == "step 2/4  eval chat 1.5 (acc 0.250)"


def test_each_tasks_learning_rate_gradient_norm_and_epoch_reach_every_sink():
    """A step's per-task learning rate, gradient norm and epochs done (the torch executor's report, #42): one
    mapping each in the JSONL row (read back as the report), ``lr/<task>``, ``grad_norm/<task>`` and
    ``epoch/<task>`` columns in the CSV and tags in TensorBoard, W&B and MLflow."""
    from lorafleet.metrics.records import flat_record, json_record, step_report, step_scalars

    report = StepReport(
        step=4, replica_busy_s=(1.0,), makespan_s=1.0, losses={"chat": 2.0}, task_lr={"chat": 1e-3},
        task_grad_norm={"chat": 0.5}, task_epoch={"chat": 1.25},
    )  # fmt: skip
    row = json.loads(json.dumps(json_record(report)))
    assert (row["task_lr"], row["task_grad_norm"], row["task_epoch"]) == ({"chat": 1e-3}, {"chat": 0.5}, {"chat": 1.25})
    assert step_report(row) == report
    flat, tags = flat_record(report), step_scalars(report)
    for key, value in (("lr/chat", 1e-3), ("grad_norm/chat", 0.5), ("epoch/chat", 1.25)):
        assert flat[key] == tags[key] == value


def test_a_full_disk_in_tensorboards_writer_thread_is_raised_by_the_writer_not_printed(tmp_path, monkeypatch):
    """#38: TensorBoard writes from a thread of its own; on a full disk that thread printed its traceback beside the
    run's one line. The thread's error goes to no excepthook and is raised by the writer's next write, as the run's
    line needs; any other thread's error goes to the hook that was there before."""
    import errno
    import threading

    pytest.importorskip("tensorboard")
    printed = []
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))
    with pytest.raises(OSError) as raised:
        with TensorBoardWriter(tmp_path / "tb") as writer:
            thread = writer._writer._get_file_writer().event_writer._async_writer._worker

            def no_space(data: bytes) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            thread._record_writer.write = no_space
            _write_all(writer)
            thread.join(timeout=30)
            assert not thread.is_alive() and isinstance(thread.exception, OSError)
            writer.write(REPORTS[0])
    assert raised.value.errno == errno.ENOSPC and printed == []

    def fails() -> None:
        raise ValueError("not a full disk")

    other = threading.Thread(target=fails)
    other.start()
    other.join()
    assert [type(e) for e in printed] == [ValueError]
