"""The containers a task's rows come in, each read into a list of rows (dicts), with what was found.

A file's kind is its content where that is unambiguous (parquet's ``PAR1`` magic, a JSON array or object) and
its suffix otherwise:

========================  ======================================================================
``.jsonl`` (or another)   one JSON object a line; blank lines ignored; a whole-file JSON array is read as one
``.json``                 an array of objects (a file of one object a line is read as JSONL)
``.parquet``              ``pyarrow.parquet``; nested columns (a chat) come back as lists and dicts
``.csv`` / ``.tsv``       a header row, then a row a line (``csv``); every cell is a string
``.txt``                  **one document a line** (blank lines skipped), each a row ``{"text": line}``: the
                          rule of ``datasets``' own text loader, and one file of many short documents is what
                          people have; a long document is one file of one line per paragraph only if each
                          paragraph stands alone, so join it into a ``.jsonl`` row instead
a directory               ``datasets.load_from_disk``: a ``Dataset``, or a ``DatasetDict`` and its splits
========================  ======================================================================

What does not fit is an InputError naming what the file is (a JSON object, a gzip file, an Arrow file, a
directory of parquet files), never a parse error of the wrong reader. A path that is neither a regular file nor a
directory (a FIFO, a device, a socket) is an InputError before anything is read: a FIFO's read blocks until
something writes to it, a device's may never end.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError

Row = dict[str, Any]

ACCEPTED = "a .jsonl, .json, .parquet, .csv or .txt file, or a directory saved by datasets' save_to_disk"
"""What a data path may be, for messages."""


@dataclass(frozen=True)
class Container:
    """The rows of one container, and what it was."""

    rows: list[Row]
    kind: str
    """What was read, in words (``JSONL file``, ``JSON array``, ``parquet file``, ``saved DatasetDict``...)."""
    split: str | None = None
    """The split read, for a saved DatasetDict."""
    splits: tuple[str, ...] = ()
    """Every split a saved DatasetDict has (in its order); empty for other containers."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
_MAGIC = (
    (b"PAR1", "a parquet file"),
    (b"\x1f\x8b", "a gzip-compressed file (decompress it first)"),
    (b"PK\x03\x04", "a zip archive (extract it first)"),
    (b"ARROW1", "an Arrow IPC file (save it with datasets' save_to_disk, or as parquet)"),
    (b"\xff\xff\xff\xff", "an Arrow stream (save it with datasets' save_to_disk, or as parquet)"),
)


def read_container(path: str | Path, split: str | None = None) -> Container:
    """The rows at ``path`` (module doc); ``split`` picks a saved DatasetDict's split (InputError elsewhere)."""
    path = Path(path)
    if path.is_dir():
        return _read_saved_dataset(path, split)
    data = _read_regular(path)
    if split is not None:
        raise InputError(str(path), "split", f"a file has no splits (split {split!r} is for a saved DatasetDict)")
    suffix = path.suffix.lower()
    if data.startswith(b"PAR1") or suffix == ".parquet":
        return Container(_read_parquet(path, data), "parquet file")
    binary = next((what for magic, what in _MAGIC if data.startswith(magic)), None)
    if binary is not None:
        raise InputError(str(path), "", f"is {binary}, not {ACCEPTED}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(
            str(path), "", f"is neither UTF-8 text nor parquet ({err.reason}); expected {ACCEPTED}"
        ) from None
    if suffix in (".csv", ".tsv"):
        return Container(_read_csv(path, text, "\t" if suffix == ".tsv" else ","), f"{suffix[1:].upper()} file")
    if suffix == ".txt":
        rows = [{"text": line} for line in text.splitlines() if line.strip()]
        return Container(rows, "text file (a document a line)")
    return _read_json(path, text)


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path`` (symlinks followed) when it is a regular file; else an InputError naming what it is.
    Opened without blocking and judged by the descriptor's own ``fstat``: a FIFO's ``open`` would wait for a
    writer, and a path checked before it is opened may be another file by then."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InputError(str(path), "", "no such file") from None
    except OSError as err:  # a symlink loop, no permission
        raise InputError(str(path), "", f"cannot read ({err.strerror or err})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((kind for test, kind in _KINDS if test(mode)), "something other than a regular file")
            raise InputError(str(path), "", f"is {kind}, not a data file or a saved dataset's directory")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as file:
            fd = -1  # the file closes it
            return file.read()
    except OSError as err:
        raise InputError(str(path), "", f"cannot read ({err.strerror or err})") from None
    finally:
        if fd >= 0:
            os.close(fd)


def _read_json(path: Path, text: str) -> Container:
    """A JSON array of objects, or JSONL; a file that is one JSON value of another shape says which."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as err:
            if not _is_json(stripped.splitlines()[0]):  # else JSONL whose first row is an array: said below
                raise InputError(
                    str(path), "", f"a JSON array that is not valid JSON ({err.msg}, line {err.lineno})"
                ) from None
        else:
            for number, row in enumerate(whole, start=1):
                if not isinstance(row, dict):
                    raise InputError(str(path), f"row {number}", f"expected a JSON object, got {_json_kind(row)}")
            return Container(whole, "JSON array")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            _whole_json_object(path, text)
            what = "a JSONL row" if path.suffix.lower() != ".json" else "a JSON row"
            raise InputError(str(path), f"row {number}", f"not valid JSON ({err.msg}) as {what}") from None
        if not isinstance(row, dict):
            raise InputError(str(path), f"row {number}", f"expected a JSON object, got {_json_kind(row)}")
        rows.append(row)
    return Container(rows, "JSONL file")


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _whole_json_object(path: Path, text: str) -> None:
    """InputError when the whole file is one JSON object spread over lines (not JSONL rows): it says so and
    names its keys (a ``{"data": [...]}`` wrapper is common)."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return
    if isinstance(whole, dict):
        keys = ", ".join(list(whole)[:8])
        raise InputError(
            str(path),
            "",
            f"is one JSON object (keys {keys}), not rows: expected an object a line (JSONL) or an array of objects",
        )


def _json_kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _read_parquet(path: Path, data: bytes) -> list[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(pa.BufferReader(data)).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise InputError(str(path), "", f"not a readable parquet file ({str(err).splitlines()[0]})") from None


def _read_csv(path: Path, text: str, delimiter: str) -> list[Row]:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    rows = []
    try:
        for number, row in enumerate(reader, start=1):
            if None in row or any(value is None for value in row.values()):
                more = "more" if None in row else "fewer"
                raise InputError(
                    str(path), f"row {number}", f"has {more} cells than the header's {len(reader.fieldnames or ())}"
                )
            rows.append(dict(row))
    except csv.Error as err:
        raise InputError(str(path), f"row {reader.line_num}", f"not valid CSV ({err})") from None
    return rows


def saved_splits(path: str | Path) -> tuple[str, ...]:
    """The split names of a saved DatasetDict at ``path``, from its ``dataset_dict.json`` (nothing else is read);
    empty for anything else, or a file that cannot be read (the reader says why)."""
    try:
        splits = json.loads((Path(path) / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return tuple(str(s) for s in splits) if isinstance(splits, list) else ()


def chosen_split(names: tuple[str, ...], split: str | None) -> str | None:
    """The split read of a DatasetDict with splits ``names``: ``split``, else ``train``, else its only one; None
    when that leaves a choice to make."""
    return split or ("train" if "train" in names else names[0] if len(names) == 1 else None)


def _read_saved_dataset(path: Path, split: str | None) -> Container:
    """A ``save_to_disk`` directory: a Dataset, or one split of a DatasetDict (``split``, else ``train``, else its
    only split)."""
    if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        found = sorted(p.suffix for p in path.iterdir() if p.is_file() and p.suffix in (".parquet", ".jsonl", ".json"))
        hint = f" (it holds {len(found)} {found[0]} files: name one)" if found else ""
        raise InputError(
            str(path), "", f"a directory that is not a saved dataset (no dataset_dict.json or state.json){hint}"
        )
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, OSError, ValueError) as err:
        raise InputError(str(path), "", f"not a readable saved dataset ({str(err).splitlines()[0]})") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = tuple(loaded)
        chosen = chosen_split(names, split)
        if chosen not in loaded:
            raise InputError(
                str(path),
                "split",
                f"the saved DatasetDict has splits {', '.join(names)}; name one (split: ...)"
                if chosen is None
                else f"no split {chosen!r} (the saved DatasetDict has {', '.join(names)})",
            )
        return Container([dict(row) for row in loaded[chosen]], "saved DatasetDict", chosen, names)
    if split is not None:
        raise InputError(
            str(path), "split", f"a saved Dataset (not a DatasetDict) has no splits to pick {split!r} from"
        )
    return Container([dict(row) for row in loaded], "saved Dataset")
