"""Flags generated from a settings dataclass's field table (:mod:`lorafleet.specs.fields`), and the dataclass
read back from a parsed command line.

A field's flag, help (its doc string, the default added), default, kind (a switch, a repeated flag, a choice of
an enum's values, a typed value) and argument group come from the field; a bad value is refused as the
dataclass is built, by its ``__post_init__``, naming the flag. ``train`` takes every flag of
:class:`~lorafleet.train.options.TrainOptions` this way (with the re-plan's, its ``replan`` field), ``simulate
--arrivals`` those of :class:`~lorafleet.specs.replan.ReplanSettings`: the same four flags, from one table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from lorafleet.specs.fields import REQUIRED, SettingField, setting_fields

REPLAN_DEST = "replan."
"""The argparse destination prefix of the re-plan's flags (``replan.horizon``), in ``train`` and ``simulate``."""


def add_field_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    into: argparse._ActionsContainer | None = None,
    prefix: str = "",
    dest: str = "",
    groups: dict[str, argparse._ArgumentGroup] | None = None,
) -> None:
    """One flag per field of ``cls`` that has its own (a shared flag is its helper's: ``--set``, ``--gpus``,
    ``--profile``), in the field order, in ``into`` (default ``parser``) or the argument group its field names;
    a field holding another table adds that table's flags. ``prefix`` starts every help text (``--arrivals: ``);
    ``dest`` every argparse destination (``replan.``)."""
    groups = {} if groups is None else groups
    here = parser if into is None else into

    def place(f: SettingField) -> argparse._ActionsContainer:
        if f.group is None:
            return here
        if f.group not in groups:
            groups[f.group] = parser.add_argument_group(f.group)
        return groups[f.group]

    for f in setting_fields(cls):
        if f.table:
            add_field_flags(parser, f.type, into=place(f), prefix=prefix, dest=f"{dest}{f.name}.", groups=groups)
        elif f.flag is not None and not f.shared:
            _add(place(f), f, prefix, dest)


def _add(into: argparse._ActionsContainer, f: SettingField, prefix: str, dest: str) -> None:
    assert f.flag is not None
    text = help_of(f, prefix).replace("%", "%%")
    if not f.flag.startswith("-"):  # positional: its destination is its name
        assert f.flag == dest + f.name and f.default is REQUIRED, f
        into.add_argument(f.flag, help=text)
        return
    into.add_argument(f.flag, dest=dest + f.name, help=text, **_kind(f))


def _kind(f: SettingField) -> dict[str, Any]:
    if f.type is bool:
        assert f.default is f.negated, f"{f.flag}: a switch turns its field from its default"
        return {"action": "store_false" if f.negated else "store_true"}
    if f.repeat:
        return {"action": "append", "default": [], "metavar": f.metavar}
    kind: dict[str, Any] = {"metavar": f.metavar}
    if f.default is REQUIRED:
        kind["required"] = True
    else:
        kind["default"] = f.default
    if f.choices is not None:
        kind["choices"] = f.choices
    elif f.type is not str:
        kind["type"] = f.type
    return kind


def help_of(f: SettingField, prefix: str = "") -> str:
    """The help of ``f``'s flag: its doc string, with its default when it has one worth saying (not a switch's,
    an empty list's, or None, whose doc string says what it means)."""
    default = f.default
    if default is REQUIRED or default is None or isinstance(default, (bool, tuple)):
        return prefix + f.doc
    shown = default.value if isinstance(default, Enum) else f"{default:g}" if isinstance(default, float) else default
    return f"{prefix}{f.doc} (default {shown})"


def field_values(
    args: argparse.Namespace,
    cls: type,
    *,
    dest: str = "",
    convert: Mapping[str, Callable[[Any], Any]] | None = None,
) -> dict[str, Any]:
    """Field name -> value of every field of ``cls`` with a flag, as the parsed ``args`` give it (a repeated
    flag's values as a tuple, or through ``convert[name]``); a field holding another table is built from its
    flags (a bad value: its InputError, naming the flag). The fields without a flag are the caller's."""
    convert = convert or {}
    values: dict[str, Any] = {}
    for f in setting_fields(cls):
        if f.table:
            values[f.name] = f.type(**field_values(args, f.type, dest=f"{dest}{f.name}."))
        elif f.flag is not None:
            value = getattr(args, dest + f.name)
            if f.name in convert:
                value = convert[f.name](value)
            elif f.repeat:
                value = tuple(value or ())
            values[f.name] = value
    return values


def add_replan_flags(parser: argparse.ArgumentParser, into: argparse._ActionsContainer, prefix: str = "") -> None:
    """The re-plan's four flags (:class:`~lorafleet.specs.replan.ReplanSettings`) in ``into``; ``train`` has them
    through ``TrainOptions.replan``."""
    from lorafleet.specs.replan import ReplanSettings

    add_field_flags(parser, ReplanSettings, into=into, prefix=prefix, dest=REPLAN_DEST)


def replan_settings(args: argparse.Namespace):
    """The ReplanSettings the re-plan's flags give; an InputError naming the flag of a bad value."""
    from lorafleet.specs.replan import ReplanSettings

    return ReplanSettings(**field_values(args, ReplanSettings, dest=REPLAN_DEST))
