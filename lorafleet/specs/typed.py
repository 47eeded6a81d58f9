"""Typed values read from JSON files: strict validation whose errors name the field path.

A file lorafleet writes (a plan, its policy, a run file, the queue's files) is read back through a
pydantic ``TypeAdapter`` of its type in *strict JSON mode*: a number where a whole number belongs
(``2.5``), a string ``"8"`` or a boolean for a count is refused, not coerced, and an unknown key is an
error. :func:`validate_strict` turns pydantic's error into one :class:`~lorafleet.errors.InputError`
naming the file and the field path (``replicas[3].gpus``).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import TypeAdapter, ValidationError

from lorafleet.errors import InputError
from lorafleet.specs.workload import describe_validation_error


@functools.cache
def adapter(kind: Any) -> TypeAdapter:
    """The (cached) pydantic adapter of ``kind``."""
    return TypeAdapter(kind)


def validate_strict(kind: Any, value: Any, source: str, where: str) -> Any:
    """``value`` (parsed JSON) as a ``kind``, validated as JSON strictly; an InputError naming ``source`` and
    ``where`` + the field path inside ``value`` when it is not one."""
    try:
        return adapter(kind).validate_json(json.dumps(value), strict=True)
    except ValidationError as err:
        error = err.errors()[0]
        loc, msg = describe_validation_error(error)
        if error.get("type") == "unexpected_keyword_argument" or error.get("type") == "extra_forbidden":
            msg = "unknown field"
        raise InputError(source, join_path(where, loc), msg) from None


def join_path(outer: str, inner: str) -> str:
    """``replicas`` + ``[3].gpus`` -> ``replicas[3].gpus``; ``policy`` + ``n_buckets`` -> ``policy.n_buckets``."""
    if not outer or not inner:
        return outer or inner
    return outer + inner if inner.startswith("[") else f"{outer}.{inner}"
