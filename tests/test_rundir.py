"""A run directory belongs to one run: the lock, used directories, overwrite, metrics cut back on resume."""

from __future__ import annotations

import csv
import json
import multiprocessing
import os

import pytest

from lorafleet.errors import InputError
from lorafleet.metrics import truncate_metrics
from lorafleet.rundir import clear_run, lock_run, used_by


def _try_lock(out: str, queue) -> None:
    try:
        lock_run(out)
        queue.put("locked")
    except InputError as err:
        queue.put(str(err))


def test_one_lock_per_directory_released_with_its_holder(tmp_path):
    lock = lock_run(tmp_path / "run")
    queue = multiprocessing.get_context("fork").Queue()
    other = multiprocessing.get_context("fork").Process(target=_try_lock, args=(str(tmp_path / "run"), queue))
    other.start()
    other.join()
    message = queue.get()
    assert "another run is using this directory" in message and f"process {os.getpid()}" in message
    lock.release()
    other = multiprocessing.get_context("fork").Process(target=_try_lock, args=(str(tmp_path / "run"), queue))
    other.start()
    other.join()
    assert queue.get() == "locked"


def test_used_and_cleared(tmp_path):
    assert used_by(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("mine")
    assert used_by(tmp_path) == ["metrics.jsonl", "checkpoints"]
    clear_run(tmp_path)
    assert used_by(tmp_path) == [] and (tmp_path / "notes.txt").read_text() == "mine"


def test_metrics_end_at_the_resumed_step(tmp_path):
    lines = [json.dumps({"step": s, "x": s}) for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "x"')  # a torn last line
    with (tmp_path / "metrics.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "x"])
        writer.writerows([[s, s] for s in range(6)])
    truncate_metrics(tmp_path, 3)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    rows = list(csv.reader((tmp_path / "metrics.csv").open()))
    assert rows == [["step", "x"], ["0", "0"], ["1", "1"], ["2", "2"]]


def test_write_text_atomic_leaves_nothing_on_failure(tmp_path):
    from lorafleet.specs.io import check_writable, write_text_atomic

    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="cannot write"):
        write_text_atomic(tmp_path / "file" / "plan.json", "{}")
    with pytest.raises(InputError, match="is a file, expected a directory"):
        check_writable(tmp_path / "file", directory=True)
    with pytest.raises(InputError, match="cannot write here"):
        check_writable(tmp_path / "file" / "sub" / "x.json")
    write_text_atomic(tmp_path / "new" / "plan.json", "{}")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["plan.json"]
