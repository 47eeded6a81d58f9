"""Where a GGUF file's metadata ends, read from its header without loading it (no ``gguf`` import, no weights).

A GGUF file (v2, v3) is ``b"GGUF"``, a uint32 version, a uint64 tensor count and a uint64 key-value count,
then the key-value pairs (a key: uint64 length and UTF-8 bytes; a uint32 value type; the value), then the
tensors' descriptions and data. A tokenizer built from the file (``transformers``' GGUF loader) reads only
key-value pairs (``tokenizer.ggml.*``, ``tokenizer.chat_template``, ``general.architecture``): bytes
``[0, metadata_end)`` hold everything it depends on, megabytes where the file is gigabytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Value type -> its size in bytes (uint8 .. float64; string and array are sized by their content)."""


def metadata_bytes(path: Path) -> bytes | None:
    """The file's bytes from its start to the end of its key-value pairs; None when it is not a GGUF file of
    version 2 or 3 whose header reads whole (its tokenizer is then not keyed: ``data.length_cache``)."""
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            if view[:4] != MAGIC or struct.unpack_from("<I", view, 4)[0] not in (2, 3):
                return None
            (pairs,) = struct.unpack_from("<Q", view, 16)
            at = 24
            for _ in range(pairs):
                at = _skip_string(view, at)
                (kind,) = struct.unpack_from("<I", view, at)
                at = _skip_value(view, at + 4, kind)
            return bytes(view[:at]) if at <= len(view) else None
    except (OSError, ValueError, struct.error, KeyError):  # unreadable, empty, cut short, an unknown value type
        return None


def _skip_string(view: mmap.mmap, at: int) -> int:
    (length,) = struct.unpack_from("<Q", view, at)
    end = at + 8 + length
    if end > len(view):
        raise ValueError("a string runs past the file's end")
    return end


def _skip_value(view: mmap.mmap, at: int, kind: int) -> int:
    """The offset after a value of type ``kind`` starting at ``at``."""
    if kind == STRING:
        return _skip_string(view, at)
    if kind != ARRAY:
        return at + FIXED_SIZES[kind]
    item, count = struct.unpack_from("<IQ", view, at)
    at += 12
    if item in FIXED_SIZES:
        return at + count * FIXED_SIZES[item]
    for _ in range(count):
        at = _skip_value(view, at, item)
    return at
