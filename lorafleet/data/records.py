"""A task's rows: read from their container (``data.readers``), their columns mapped and their format resolved
(``data.formats``), each row turned into what it renders to. No tokenizer is needed, so ``lorafleet validate``
checks every row of every task's data without one.

A bad row is an :class:`InputError` naming the file and the row (1-based, as an editor shows it; a saved
DatasetDict's split is named with the file), never a skipped row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet.data.formats import Unit, map_columns, resolve_format, to_unit
from lorafleet.data.readers import Container, Row, read_container
from lorafleet.specs.data import DataFormat, DataSpec

__all__ = ["Row", "TaskRows", "read_rows", "read_task_rows", "task_rows"]


@dataclass(frozen=True)
class TaskRows:
    """The rows of a task's ``data``, ready to render."""

    source: str
    """The file as errors name it: its path, and a saved DatasetDict's split (``data/qa (split test)``)."""
    container: Container
    format: DataFormat
    """The format every row is of (``auto`` resolved by the first row; ``auto`` only when there is no row)."""
    units: tuple[Unit, ...]


def read_rows(path: str | Path) -> list[Row]:
    """Every row at ``path`` as read (``data.readers``: a file, or a saved dataset's default split)."""
    return read_container(path).rows


def read_task_rows(spec: DataSpec) -> TaskRows:
    """The rows of ``spec`` (its path, split, columns and format), each checked and converted."""
    container = read_container(spec.path, spec.split)
    source = spec.path if container.split is None else f"{spec.path} (split {container.split})"
    return task_rows(container, spec, source)


def task_rows(container: Container, spec: DataSpec, source: str) -> TaskRows:
    """``container``'s rows under ``spec``'s columns and format; ``source`` names the file in errors."""
    rows = [map_columns(row, spec.columns, (source, f"row {i}")) for i, row in enumerate(container.rows, start=1)]
    fmt = resolve_format(rows[0], spec.format, (source, "row 1")) if rows else spec.format
    units = tuple(to_unit(row, fmt, (source, f"row {i}")) for i, row in enumerate(rows, start=1))
    return TaskRows(source, container, fmt, units)
