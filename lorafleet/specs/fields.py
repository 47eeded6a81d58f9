"""The field table of a settings dataclass: each field's command-line flag, doc string, default and bounds in
one place, as :mod:`lorafleet.specs.dispatch` has them for the dispatch policy.

A field says how it is set on the command line with ``field(metadata=flag(...))`` and what it means with its
attribute doc string, written as the flag's help (the same text is its description in the JSON Schema of a file
that holds it, such as the run file). :func:`setting_fields` walks a dataclass's fields into
:class:`SettingField` rows; ``commands._option_flags`` generates the argparse flags (names, kinds, help with the
default, argument groups) from the rows and reads a parsed command line back into the dataclass, and
:func:`check_fields` (called by the dataclass's ``__post_init__``) turns a string given for an enum field into
its member and checks the fields' lower bounds, an :class:`~lorafleet.errors.InputError` naming the field's
flag. So a flag's name, default, help and bound are each written once, beside its field.

:class:`~lorafleet.specs.replan.ReplanSettings` and :class:`lorafleet.train.options.TrainOptions` are tables.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lorafleet.errors import InputError
from lorafleet.specs.field_docs import field_help

ARGS = "<args>"
"""The source an InputError about a flag names."""
REQUIRED = dataclasses.MISSING
"""The default of a field that has none (:attr:`SettingField.default`)."""


def flag(
    name: str,
    metavar: str | None = None,
    *,
    least: float | None = None,
    negated: bool = False,
    repeat: bool = False,
    group: str | None = None,
    shared: bool = False,
) -> dict[str, Any]:
    """A field's metadata: the command-line flag that sets it (see :class:`SettingField` for the options)."""
    return {
        "flag": name,
        "metavar": metavar,
        "least": least,
        "negated": negated,
        "repeat": repeat,
        "group": group,
        "shared": shared,
    }


def in_group(title: str) -> dict[str, Any]:
    """The metadata of a field holding another table: its flags go in the argument group ``title``."""
    return {"group": title}


@dataclass(frozen=True, kw_only=True, slots=True)
class SettingField:
    """One field of a settings dataclass as the command line and its files name it."""

    name: str
    """Its attribute name: the argparse destination of its flag, prefixed by the fields holding it."""
    owner: type
    """The dataclass that declares it."""
    type: Any
    """Its type; a union with None is the other member (the field's None is its default's sentinel)."""
    default: Any
    """Its default (:data:`REQUIRED`: none)."""
    flag: str | None = None
    """The flag that sets it: ``--steps``; a name without dashes is positional; None: no flag."""
    metavar: str | None = None
    least: float | None = None
    """The least value it may have (:func:`check_fields`); a float's must also be finite."""
    negated: bool = False
    """A switch on by default that its flag turns off (``--no-progress`` sets ``progress`` False)."""
    repeat: bool = False
    """The flag may be given again; the field holds the values in order (a tuple)."""
    group: str | None = None
    """The title of the argument group its flag is listed in (None: the command's own options)."""
    shared: bool = False
    """Its flag is declared by a helper every command that takes it shares (``--set``, ``--gpus``,
    ``--profile``: ``commands._set_flags``, ``commands._plan_flags``), under the field's name as destination."""
    table: bool = False
    """It holds another table (a nested settings dataclass), whose fields have the flags."""

    @property
    def doc(self) -> str:
        """Its doc string, on one line: the help of its flag (with the default added) and its JSON Schema
        description (read from the source when asked for, ``specs.field_docs``)."""
        return field_help(self.owner, self.name)

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The values an enum field takes, as given on the command line."""
        if isinstance(self.type, type) and issubclass(self.type, Enum):
            return tuple(e.value for e in self.type)
        return None


@functools.cache
def setting_fields(cls: type) -> tuple[SettingField, ...]:
    """The field table of the dataclass ``cls``, in declaration order."""
    return tuple(_walk(cls))


def flag_of(cls: type, name: str) -> str:
    """The flag of ``cls``'s field ``name`` (the field's name when it has none)."""
    return _metadata(cls)[name].get("flag") or name


def check_fields(obj: Any, source: str = ARGS) -> None:
    """Called by a table's ``__post_init__``: each enum field given as a string becomes its member (a frozen
    dataclass's, in place), and each field with a ``least`` bound is checked; an InputError naming ``source`` and
    the field's flag otherwise."""
    cls = type(obj)
    hints = _hints(cls)
    for name, meta in _metadata(cls).items():
        kind, value = _plain(hints[name]), getattr(obj, name)
        where = meta.get("flag") or name
        if isinstance(kind, type) and issubclass(kind, Enum) and not isinstance(value, kind):
            try:
                object.__setattr__(obj, name, kind(value))
            except ValueError:
                raise InputError(source, where, f"expected {_alternatives(kind)}, got {value!r}") from None
        least = meta.get("least")
        if least is None or value is None:
            continue
        if kind is float and not (math.isfinite(value) and value >= least):
            raise InputError(source, where, f"must be a finite number >= {least}, got {value}")
        if kind is not float and value < least:
            raise InputError(source, where, f"must be >= {least}, got {value}")


def _alternatives(kind: type[Enum]) -> str:
    """``makespan or gpu-s``, ``auto, cpu or cuda``."""
    values = [e.value for e in kind]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _metadata(cls: type) -> dict[str, typing.Mapping[str, Any]]:
    return {f.name: f.metadata for f in dataclasses.fields(cls)}


def _plain(kind: Any) -> Any:
    """``float`` of ``float | None``; any other type as it is."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(others) == 1:
            return others[0]
    return kind


def _walk(cls: type) -> Iterator[SettingField]:
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        kind = _plain(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        meta = f.metadata
        yield SettingField(
            name=f.name,
            owner=cls,
            type=kind,
            default=default,
            flag=meta.get("flag"),
            metavar=meta.get("metavar"),
            least=meta.get("least"),
            negated=meta.get("negated", False),
            repeat=meta.get("repeat", False),
            group=meta.get("group"),
            shared=meta.get("shared", False),
            table=dataclasses.is_dataclass(kind),
        )
