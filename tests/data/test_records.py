"""A task's rows (``data.records``): a data path that is neither a file nor a saved dataset's directory is one
InputError, never a read that blocks (a FIFO) or never ends (a device)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lorafleet.cli import main
from lorafleet.data.records import read_rows
from lorafleet.errors import InputError


@contextlib.contextmanager
def _never_blocked(fifo: Path) -> Iterator[None]:
    """Whatever opens ``fifo`` for reading in the block is let through: a writer opens it and closes it at once,
    so a reader that blocks in ``open`` (the code before #38) reads an empty file instead of hanging the test."""
    done = threading.Event()

    def let_through() -> None:
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader has it open
            except OSError:
                pass
            done.wait(0.01)

    thread = threading.Thread(target=let_through, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.parametrize("kind", ["FIFO", "character device"])
def test_a_data_path_that_is_a_fifo_or_a_device_is_one_input_error(tmp_path, kind):
    """#38: a workload's data path that is a FIFO blocked the read until something opened it for writing (rank
    0 at a queue's boundary; the launcher's check of the data); ``/dev/null`` read as an empty dataset."""
    path = tmp_path / "rows.jsonl"
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path = Path(os.devnull)
    with _never_blocked(path) if kind == "FIFO" else contextlib.nullcontext():
        with pytest.raises(InputError) as err:
            read_rows(path)
    assert str(err.value) == f"{path}: is a {kind}, not a data file or a saved dataset's directory"


def test_a_workload_whose_data_is_a_fifo_is_one_line_and_exit_2(tmp_path, capsys):
    fifo = tmp_path / "chat.jsonl"
    os.mkfifo(fifo)
    workload = tmp_path / "w.yaml"
    task = {"name": "chat", "data": {"path": str(fifo)}, "batch_size": 4, "context_length": 512}
    workload.write_text(yaml.safe_dump({"model": "tiny-llama", "tasks": [task]}))
    with _never_blocked(fifo):
        code = main(["validate", str(workload)])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert f"{fifo}: is a FIFO, not a data file or a saved dataset's directory" in err, err


def test_a_file_and_a_saved_datasets_directory_still_read(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert read_rows(path) == [{"text": "a"}, {"text": "b"}]
    (tmp_path / "link.jsonl").symlink_to(path)
    assert read_rows(tmp_path / "link.jsonl") == [{"text": "a"}, {"text": "b"}]
    with pytest.raises(InputError, match="no such file"):
        read_rows(tmp_path / "missing.jsonl")
