"""Shared base for the typed, validated specs (pydantic v2).

Specs are frozen and reject unknown keys, so a typo in a YAML file is an error that names
the key instead of a silently ignored setting; they reject NaN and infinities in every number
(``alpha: .inf`` would train NaN adapters).

Their numbers and switches are strict (:data:`Int`, :data:`Bool`, :data:`Float`): pydantic's lax mode
reads ``nodes: true`` as 1 node, ``batch_size: 2.0`` as 2 and ``use_rslora: 1`` as true, which a YAML
file (or a ``--set``) gets by mistake far more often than on purpose. A whole number is an integer and
nothing else (not ``2.0``: files lorafleet writes and reads back are read the same way,
``specs.typed``); a switch is ``true`` or ``false``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Strict
from pydantic_core import PydanticCustomError

from lorafleet.specs.field_docs import documented


def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number, not a boolean")
    return value


def _not_a_boolean_key(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


Int = Annotated[int, Strict()]
"""A whole number, strictly: a boolean, ``2.0`` or ``"2"`` is refused (lax pydantic reads them as 1, 2, 2)."""
Bool = Annotated[bool, Strict()]
"""``true`` or ``false``, strictly: not ``1`` or ``"yes"``."""
IntKey = Annotated[int, BeforeValidator(_not_a_boolean_key)]
"""A whole number as a mapping's key: not a boolean, but a string of digits is its number (JSON keys are
strings, and a written workload's histogram keys come back as them)."""
Float = Annotated[float, BeforeValidator(_not_a_boolean)]
"""A number (an integer is one): not a boolean. A string that spells a number is read as it (PyYAML reads
``1e-4``, without a dot, as a string)."""


class Spec(BaseModel):
    """Base of every spec: immutable, no unknown keys, finite numbers only; each field's doc string is its JSON
    Schema description (``specs.field_docs``)."""

    model_config = documented(extra="forbid", frozen=True, allow_inf_nan=False)


class FieldError(ValueError):
    """A validation error that knows which sub-field it is about (pydantic reports only the validator's field)."""

    def __init__(self, loc: tuple[int | str, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
