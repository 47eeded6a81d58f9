"""Files on disk, one rule each: JSON read with one-line errors (plans, profiles, HF configs, typed files),
every file and every directory written whole or not at all, and a file's SHA-256."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from lorafleet.errors import InputError
from lorafleet.specs.workload import describe_validation_error

T = TypeVar("T")


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


def read_json_as(path: str | Path, adapter: TypeAdapter[T], what: str) -> T:
    """The JSON file ``path`` validated as ``adapter``'s type (a file lorafleet writes and reads back: the task
    ledger, the pending queue changes). An InputError naming the file: ``not a lorafleet <what> (...)`` when
    it is not JSON or not an object at all, else the field path of the first wrong value
    (``tasks[2].spec.batch_size: ...``; unknown keys are wrong values)."""
    src = str(path)
    try:
        text = Path(path).read_bytes()
    except OSError as err:
        raise InputError(src, "", f"cannot read ({err.strerror or err})") from None
    try:
        return adapter.validate_json(text)
    except ValidationError as err:
        first = err.errors()[0]
        where, message = describe_validation_error(first)
        if first["type"] == "json_invalid" or not where:
            raise InputError(src, "", f"not a lorafleet {what} ({message})") from None
        raise InputError(src, where, message) from None


def write_json_as(path: str | Path, adapter: TypeAdapter[T], value: T) -> Path:
    """``value`` as ``adapter`` serialises it: indented JSON with sorted keys, written by :func:`write_text_atomic`."""
    return write_text_atomic(path, json.dumps(adapter.dump_python(value, mode="json"), indent=2, sort_keys=True) + "\n")


def write_text_atomic(path: str | Path, text: str, *, mode: int | None = None) -> Path:
    """Write ``text`` to ``path`` whole or not at all: a ``.``-named temporary file beside it, flushed to disk,
    then ``os.replace``.

    A reader never sees half a file (a directory watcher skips the ``.``-named temporary), a crash leaves
    the old file or the new one, and a failed write leaves neither a partial target nor the temporary
    behind. ``mode``: the file's permission bits, exactly, from its first byte (``0o600``: private);
    default: what the umask gives a new file. An unwritable place (no permission, a file where a folder
    should be, a full disk) is an InputError naming the path.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            if mode is not None:
                os.fchmod(out.fileno(), mode)  # the umask may have cleared bits that mode asks for
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        with contextlib.suppress(OSError):  # cleanup only: the error raised below is the one that matters
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise InputError(str(path), "", f"cannot write ({err.strerror or err})") from None
        raise
    return target


@contextlib.contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """Write the directory ``target`` whole or not at all: yields an empty staging directory beside it,
    ``.<name>.partial``, for the caller to fill; on success renames it into place, on failure removes it.

    A stale staging directory (left by a crash) is removed first; something else in its place, a file,
    is not (``mkdir`` fails: a file in the way is not this writer's to delete). An existing ``target``
    is replaced: moved aside to ``.<name>.old``, the staging renamed to ``target``, then the old one
    removed, so ``target`` is the old directory or the new one, except for the instant between the two
    renames. Nothing is fsynced: whole against a crash of the process, not a power loss (a checkpoint
    checks its files' SHA-256 when it is resumed). Errors are raised as they are (an OSError is a
    failed write, not bad input), after the staging directory is removed.
    """
    target = Path(target)
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks (a plan's record of its profile, a checkpoint's
    of each of its files)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_writable(path: str | Path, *, directory: bool = False) -> None:
    """An InputError naming ``path`` now, before any work, when it could not be written later: a
    directory where a file goes (or the reverse), or a nearest existing folder that is not writable
    (by this process's effective user: what the write will be checked against; :func:`write_text_atomic`
    writes beside the target, so the folder must be writable, not only the file)."""
    target = Path(path)
    if target.exists() and target.is_dir() != directory:
        raise InputError(
            str(path), "", "is a directory, expected a file" if not directory else "is a file, expected a directory"
        )
    parent = target if directory and target.exists() else target.parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK, effective_ids=True):
        raise InputError(str(path), "", f"cannot write here ({parent} is not a writable directory)")
