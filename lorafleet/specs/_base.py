"""Shared base for the typed, validated specs (pydantic v2).

Specs are frozen and reject unknown keys, so a typo in a YAML file is an error that names
the key instead of a silently ignored setting; they reject NaN and infinities in every number
(``alpha: .inf`` would train NaN adapters).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """Base of every spec: immutable, no unknown keys, finite numbers only."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)


class FieldError(ValueError):
    """A validation error that knows which sub-field it is about (pydantic reports only the validator's field)."""

    def __init__(self, loc: tuple[int | str, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
