"""Errors that reach the user.

Every bad input (a workload file, a dataset row, a cluster that cannot hold the model)
ends as an :class:`InputError` naming *where* it is wrong. ``lorafleet.cli`` prints it as
one line and exits with code 2; nothing else in the package catches it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


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


def exit_code(run: Callable[[], int | None], prog: str = "lorafleet") -> int:
    """``run()``'s exit code, or, when it raises an InputError, the error printed as one line on stderr
    and :data:`EXIT_INPUT_ERROR` (what every lorafleet entry point does: no traceback for bad input)."""
    try:
        return int(run() or 0)
    except InputError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR


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
