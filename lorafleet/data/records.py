"""Rows of a task's dataset, from a JSONL file or a ``datasets.save_to_disk`` directory.

A bad row is an :class:`InputError` naming the file and the row (1-based, as an editor
shows it), never a skipped row. A path that is neither a regular file nor a directory (a FIFO,
a device, a socket) is an InputError before anything is read: a FIFO's read blocks until
something writes to it, a device's may never end.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError
from lorafleet.specs.data import DataFormat

Row = dict[str, Any]


def read_rows(path: str | Path) -> list[Row]:
    """All rows of a JSONL file (one JSON object a line; blank lines ignored) or a saved HF dataset."""
    path = Path(path)
    if path.is_dir():
        return _read_hf_dataset(path)
    return list(_read_jsonl(path))


def _read_jsonl(path: Path) -> Iterator[Row]:
    try:
        lines = _read_regular(path).decode("utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(str(path), "", "no such file") from None
    except UnicodeDecodeError as err:
        raise InputError(str(path), "", f"not UTF-8 text ({err.reason})") from None
    except OSError as err:  # a symlink loop, a directory, no permission
        raise InputError(str(path), "", f"cannot read ({err.strerror or err})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(str(path), f"row {number}", f"not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise InputError(str(path), f"row {number}", "expected a JSON object")
        yield row


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path`` (symlinks followed) when it is a regular file; else an InputError naming what it is.
    Opened without blocking and judged by the descriptor's own ``fstat``: a FIFO's ``open`` would wait for a
    writer, and a path checked before it is opened may be another file by then."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((kind for test, kind in _KINDS if test(mode)), "something other than a regular file")
            raise InputError(str(path), "", f"is {kind}, not a JSONL file or a saved dataset's directory")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as file:
            fd = -1  # the file closes it
            return file.read()
    finally:
        if fd >= 0:
            os.close(fd)


def _read_hf_dataset(path: Path) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise InputError(
            str(path), "", "a dataset directory needs the `datasets` package (pip install datasets)"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise InputError(str(path), "", f"not a saved Hugging Face dataset ({err})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise InputError(str(path), "", f"dataset has no 'train' split (has {', '.join(loaded)})")
        loaded = loaded["train"]
    return [dict(row) for row in loaded]


def detect_format(row: Row, requested: DataFormat) -> DataFormat:
    """The concrete format of a row (``AUTO`` resolved by which fields it has)."""
    if requested is not DataFormat.AUTO:
        return requested
    if "messages" in row:
        return DataFormat.MESSAGES
    if "prompt" in row and "response" in row:
        return DataFormat.PROMPT_RESPONSE
    if "text" in row:
        return DataFormat.TEXT
    return DataFormat.AUTO  # caller reports the missing fields
