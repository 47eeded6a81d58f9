"""Errors that reach the user.

Every bad input (a workload file, a dataset row, a cluster that cannot hold the model)
ends as an :class:`InputError` naming *where* it is wrong. ``lorafleet.cli`` prints it as
one line and exits with code 2; nothing else in the package catches it.
"""

from __future__ import annotations

import errno
import re
import sys
from collections.abc import Callable
from importlib import metadata


class InputError(Exception):
    """Bad user input: ``path: field: message``.

    Args:
        path: the file (or other source) the input came from; ``"<args>"`` for CLI flags.
        field: a dotted path into that source (``tasks[2].lengths.mean``), or a row
            (``row 17``); empty when the whole source is wrong (malformed YAML).
        msg: what is wrong, in one line.
    """

    def __init__(self, path: str, field: str, msg: str) -> None:
        self.path = str(path)
        self.field = field
        self.msg = " ".join(str(msg).split())  # always one line
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.path}: {self.field}" if self.field else self.path
        return f"{where}: {self.msg}"


EXIT_INPUT_ERROR = 2
"""The exit code of a process that stopped on an InputError."""


FULL_DISK = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
"""The errors of a full disk, by errno, as a run's line says them (``train.failures``)."""
FULL_DISK_WORDS = (
    (re.compile(r"Disk quota exceeded|\bEDQUOT\b|QuotaExceeded|os error 122\b", re.IGNORECASE), errno.EDQUOT),
    (re.compile(r"No space left on device|\bENOSPC\b|StorageFull|os error 28\b", re.IGNORECASE), errno.ENOSPC),
)
"""The same in the words of an error that is not an OSError (safetensors' ``SafetensorError``, torch's writers)."""


def full_disk(err: BaseException) -> tuple[int, str | None] | None:
    """``(errno, path)`` when ``err``, or an error it was raised from or while handling, is a full disk
    (:data:`FULL_DISK`): an OSError, whose file name is the path (None when the failed call had none: a
    ``write`` or a ``flush``), or another error in its words (:data:`FULL_DISK_WORDS`; no path). None otherwise."""
    chain, seen, worded = [err], set(), None
    while chain:
        e = chain.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_DISK:
            return e.errno, None if e.filename is None else str(e.filename)
        if worded is None:
            worded = next((code for words, code in FULL_DISK_WORDS if words.search(str(e))), None)
        chain += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None if worded is None else (worded, None)


def exit_code(run: Callable[[], int | None], prog: str = "lorafleet") -> int:
    """``run()``'s exit code, or, when it raises an InputError, the error printed as one line on stderr
    and :data:`EXIT_INPUT_ERROR` (what every lorafleet entry point does: no traceback for bad input). A hard
    dependency that is not installed is one line as well (:func:`missing_dependency`)."""
    try:
        return int(run() or 0)
    except InputError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except ModuleNotFoundError as err:
        line = missing_dependency(err)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return EXIT_INPUT_ERROR


IMPORT_NAMES = {"pyyaml": "yaml"}
"""A distribution's import name where it is not the distribution's own name (lower case, ``-`` as ``_``)."""


def hard_requirements() -> dict[str, str]:
    """lorafleet's hard dependencies, import name -> requirement (``pulp`` -> ``pulp<4,>=3.3``), from the
    installed package's metadata (pyproject's ``dependencies``; extras left out); empty when lorafleet is not
    installed."""
    try:
        requires = metadata.requires("lorafleet") or []
    except metadata.PackageNotFoundError:
        return {}
    hard = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra" in marker:
            continue
        match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
        if match is not None:
            name = match.group().lower().replace("-", "_")
            hard[IMPORT_NAMES.get(name, name)] = requirement.strip()
    return hard


def missing_dependency(err: ModuleNotFoundError) -> str | None:
    """The one line for an import that failed because a hard dependency of lorafleet is not installed (its name
    and the command that installs it); None for any other missing module (a bug, whose traceback stays)."""
    top = (err.name or "").partition(".")[0]
    requirement = hard_requirements().get(top)
    if requirement is None:
        return None
    return f"the package {top} that lorafleet needs is not installed (pip install '{requirement}')"


class StartTimeout(RuntimeError):
    """A run's process group did not form in time: a rank never arrived (stuck starting, or on a node that
    never joined). The worker that waited says so; the launcher's one line names it (``train.failures``)."""


class SolverFallbackWarning(UserWarning):
    """A solver failed or timed out and a heuristic result was used instead."""


def coerce_enum_fields(options: object, source: str, fields: dict) -> None:
    """Turn string values of a frozen dataclass's enum fields into their enums, in place.

    ``fields`` maps field name -> StrEnum class; a value that is not a member raises an
    InputError naming ``source``, the field and the choices.
    """
    for name, enum in fields.items():
        value = getattr(options, name)
        try:
            object.__setattr__(options, name, enum(value))
        except ValueError:
            raise InputError(source, name, f"{value!r} is not one of {', '.join(e.value for e in enum)}") from None
