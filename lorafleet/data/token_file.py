"""One tokenized dataset in one file: every row's token ids and labels, compact, read back exactly or not at all.

Layout (little-endian; each section starts at a multiple of 8 bytes)::

    b"LFTOKS1\\n"                 magic, 8 bytes
    H                            uint64: the header's length in bytes
    header                       H bytes of JSON: rows n, tokens T, the ids' dtype, the labels' encoding,
                                 the offsets' SHA-256 and the payload's SHA-256
    offsets   int64[n + 1]       row i is tokens offsets[i] .. offsets[i + 1]; offsets[0] = 0, offsets[n] = T
    ids       uint16 | int32[T]  uint16 when every id is below 2**16 (SmolLM2's 49,152, the tiny BPE's), else int32
                                 (int64 for ids beyond it)
    labels    "mask": uint8[ceil(T / 8)], np.packbits of (label == id): a learnt token's label is its id,
              every other one IGNORE_INDEX (-100) -- what ``data.tokenize`` gives for every template whose
              renderings extend each other; else int32[T] (or int64), the labels themselves

So a row of ``L`` tokens takes ``2L + L/8`` bytes (uint16 ids and a mask), ``4L + L/8`` (int32 ids), plus 8 for
its offset: the demo's 960 rows, 355,152 tokens, 763,440 bytes. The examples it is read into are the form any
tokenization gives (tuples of Python ints), ~80 bytes a token, ~110 at the peak of reading.

**Exact or nothing.** A reader checks the magic, that the file is exactly as long as its header says, the
payload's SHA-256 (the offsets' alone when only the lengths are read) and that the offsets rise from 0 to
``T``; anything else (a truncated, corrupt or foreign file) reads as no entry, which
its caller rebuilds. :func:`write_examples` writes a temporary file beside the entry and renames it over
(``os.replace``: atomic on POSIX), so a reader, in this process or another writing the same entry at the same
time, sees a whole file or none; one cut short by a crash before the data reached the disk fails the hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lorafleet.data.tokenize import IGNORE_INDEX, Example

MAGIC = b"LFTOKS1\n"
ALIGN = 8
MAX_HEADER = 4096
"""A header's JSON is ~250 bytes: a longer one is not read."""
HEADER_KEYS = frozenset({"rows", "tokens", "ids", "labels", "offsets_sha256", "sha256"})
ID_DTYPES = ("<u2", "<i4", "<i8")
LABEL_ENCODINGS = ("mask", "<i4", "<i8")


class CorruptEntry(ValueError):
    """A file that is not a whole entry of this format (its caller rebuilds it)."""


def write_examples(path: Path, examples: Sequence[Example]) -> int:
    """``examples`` into ``path`` atomically (module doc); the file's size in bytes. OSError when it cannot be
    written (no temporary file is left behind)."""
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum(np.fromiter((len(e) for e in examples), np.int64, count=len(examples)), out=offsets[1:])
    ids = np.fromiter((t for e in examples for t in e.input_ids), np.int64, count=int(offsets[-1]))
    labels = np.fromiter((t for e in examples for t in e.labels), np.int64, count=int(offsets[-1]))
    ids_dtype = _smallest(ids, ID_DTYPES)
    learnt = labels == ids
    if np.all(learnt | (labels == IGNORE_INDEX)):
        encoding, label_section = "mask", np.packbits(learnt).tobytes()
    else:
        encoding = _smallest(labels, LABEL_ENCODINGS[1:])
        label_section = labels.astype(encoding).tobytes()
    sections = [offsets.astype("<i8").tobytes(), ids.astype(ids_dtype).tobytes(), label_section]
    payload = b"".join(_padded(s) for s in sections)
    header = {
        "rows": len(examples),
        "tokens": int(offsets[-1]),
        "ids": ids_dtype,
        "labels": encoding,
        "offsets_sha256": hashlib.sha256(sections[0]).hexdigest(),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    head = _padded(json.dumps(header).encode(), b" ")  # JSON's own whitespace
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("wb") as out:
            out.write(MAGIC + len(head).to_bytes(8, "little") + head + payload)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(MAGIC) + 8 + len(head) + len(payload)


def read_lengths(path: Path) -> np.ndarray:
    """Every row's token count (int64), from the offsets alone (memory-mapped: the tokens are not read).
    OSError: no file; :class:`CorruptEntry`: not a whole entry."""
    entry = _Entry.open(path)
    return np.diff(entry.offsets())


def read_examples(path: Path) -> list[Example]:
    """The examples the file holds, equal to those written. OSError: no file; :class:`CorruptEntry`: not a
    whole entry."""
    entry = _Entry.open(path)
    if hashlib.sha256(entry.data[entry.starts[0] :]).hexdigest() != entry.header["sha256"]:
        raise CorruptEntry("the payload's hash differs")
    offsets = entry.offsets().tolist()
    ids = entry.section(1, entry.header["ids"]).astype(np.int64)
    if entry.header["labels"] == "mask":
        learnt = np.unpackbits(entry.section(2, "u1"), count=entry.tokens).astype(bool)
        labels = np.where(learnt, ids, IGNORE_INDEX)
    else:
        labels = entry.section(2, entry.header["labels"]).astype(np.int64)
    id_list, label_list = ids.tolist(), labels.tolist()
    return [
        Example(tuple(id_list[a:b]), tuple(label_list[a:b])) for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


class _Entry:
    """An entry's checked header and its file memory-mapped, by section (offsets, ids, labels)."""

    def __init__(self, header: dict[str, Any], start: int, sizes: tuple[int, int, int], data: np.ndarray) -> None:
        self.header, self.data, self.sizes = header, data, sizes
        self.tokens = header["tokens"]
        self.starts = (start, start + _padded_size(sizes[0]), start + _padded_size(sizes[0]) + _padded_size(sizes[1]))

    @classmethod
    def open(cls, path: Path) -> _Entry:
        """The entry at ``path``: one open file read throughout (a writer renaming another over it meanwhile
        changes nothing here)."""
        with path.open("rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            lead = handle.read(len(MAGIC) + 8)
            if len(lead) < len(MAGIC) + 8 or lead[: len(MAGIC)] != MAGIC:
                raise CorruptEntry("no magic")
            size = int.from_bytes(lead[len(MAGIC) :], "little")
            if size > min(MAX_HEADER, file_size):
                raise CorruptEntry(f"a header of {size} bytes")
            header = _header(handle.read(size))
            start = len(MAGIC) + 8 + size
            tokens, labels = header["tokens"], header["labels"]
            label_bytes = (tokens + 7) // 8 if labels == "mask" else tokens * np.dtype(labels).itemsize
            sizes = (8 * (header["rows"] + 1), tokens * np.dtype(header["ids"]).itemsize, label_bytes)
            expected = start + sum(_padded_size(n) for n in sizes)
            if file_size != expected:
                raise CorruptEntry(f"{file_size} bytes where the header says {expected}")
            return cls(header, start, sizes, np.memmap(handle, dtype=np.uint8, mode="r"))

    def section(self, index: int, dtype: str) -> np.ndarray:
        """Section ``index`` (0 offsets, 1 ids, 2 labels) as an array of ``dtype`` (a view of the mapped file)."""
        start = self.starts[index]
        return self.data[start : start + self.sizes[index]].view(dtype)

    def offsets(self) -> np.ndarray:
        """The offsets, checked by their own hash (what the lengths read) and their rise from 0 to the tokens."""
        if hashlib.sha256(self.section(0, "u1")).hexdigest() != self.header["offsets_sha256"]:
            raise CorruptEntry("the offsets' hash differs")
        offsets = self.section(0, "<i8")
        if offsets[0] != 0 or offsets[-1] != self.tokens or np.any(np.diff(offsets) < 0):
            raise CorruptEntry("the offsets do not rise from 0 to the token count")
        return offsets


def _header(raw: bytes) -> dict[str, Any]:
    """The header's JSON, every field of the right kind; CorruptEntry otherwise."""
    try:
        header = json.loads(raw)
    except ValueError as err:
        raise CorruptEntry(f"unreadable header ({err})") from None
    if not isinstance(header, dict) or set(header) != HEADER_KEYS:
        raise CorruptEntry("not this format's header")
    rows, tokens = header["rows"], header["tokens"]
    if not (isinstance(rows, int) and isinstance(tokens, int) and rows >= 0 and tokens >= 0):
        raise CorruptEntry("a bad row or token count")
    if header["ids"] not in ID_DTYPES or header["labels"] not in LABEL_ENCODINGS:
        raise CorruptEntry(f"unknown encodings {header['ids']!r}, {header['labels']!r}")
    return header


def _smallest(values: np.ndarray, dtypes: Sequence[str]) -> str:
    """The first of ``dtypes`` that holds every one of ``values`` exactly."""
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    return next(d for d in dtypes if np.iinfo(d).min <= low and high <= np.iinfo(d).max)


def _padded_size(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _padded(section: bytes, fill: bytes = b"\0") -> bytes:
    return section + fill * (_padded_size(len(section)) - len(section))
