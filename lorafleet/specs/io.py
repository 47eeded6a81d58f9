"""Reading the JSON files users hand to lorafleet (plans, profiles, HF configs) with one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; an InputError naming the file when it is missing, a directory,
    not UTF-8 JSON, or not an object."""
    src = str(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(src, "", "no such file") from None
    except IsADirectoryError:
        raise InputError(src, "", "is a directory, expected a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(src, "", f"not valid JSON ({err})") from None
    except OSError as err:  # a symlink loop, no permission
        raise InputError(src, "", f"cannot read ({err.strerror or err})") from None
    if not isinstance(raw, dict):
        raise InputError(src, "", "expected a JSON object")
    return raw


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all: a temporary file beside it, then ``os.replace``.

    A reader never sees half a file, and a failed write leaves neither a partial target nor
    the temporary behind. An unwritable place (no permission, a file where a folder should
    be, a full disk) is an InputError naming the path.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as err:
        with contextlib.suppress(OSError):  # cleanup only: the error raised below is the one that matters
            tmp.unlink(missing_ok=True)
        raise InputError(str(path), "", f"cannot write ({err.strerror or err})") from None
    return target


def check_writable(path: str | Path, *, directory: bool = False) -> None:
    """An InputError naming ``path`` now, before any work, when it could not be written later: a
    directory where a file goes (or the reverse), or a nearest existing folder that is not writable."""
    target = Path(path)
    if target.exists() and target.is_dir() != directory:
        raise InputError(
            str(path), "", "is a directory, expected a file" if not directory else "is a file, expected a directory"
        )
    parent = target if directory and target.exists() else target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(str(path), "", f"cannot write here ({parent} is not a writable directory)")
