"""A field's doc string, read from its class's source when a JSON Schema or a help text asks for it.

The rule is pydantic's ``use_attribute_docstrings``: a string statement right after an annotated assignment in a
class body documents that attribute, ``inspect.cleandoc``'d::

    n_buckets: Int = 16
    \"\"\"R, the most buckets per step\"\"\"

pydantic applies its rule as it creates each class (frame inspection, ``inspect.getblock``'s tokenizing and two
``ast.parse`` a class: ~0.07 CPU s of ``lorafleet plan``'s start, whose imports create 39 documented classes),
although only ``lorafleet schema`` and the flags' help read the descriptions. Here a module's source is parsed
once, the first time one of its classes' doc strings is asked for, and cached:

- :func:`field_doc`: the doc string of a class's field; an inherited field's is its declaring class's (the
  nearest class of the MRO that annotates the name; pydantic's rule keeps it for a model, not for a dataclass);
  :func:`field_help`, the same on one line;
- :func:`documented`: the pydantic config of a documented model, dataclass or TypedDict: its ``json_schema_extra``
  hook, :func:`describe_fields`, writes each field's doc string as its JSON Schema ``description``, as pydantic's
  rule did (over what the field's type says of itself, such as a ``WithJsonSchema``'s description).

``specs.dispatch.policy_fields`` and ``specs.fields.setting_fields`` read their tables' docs with :func:`field_help`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import ConfigDict


def documented(**config: Any) -> ConfigDict:
    """The pydantic config ``config`` (``extra="forbid"``, ...) of a class whose JSON Schema describes each field
    by its doc string (:func:`describe_fields`)."""
    return ConfigDict(json_schema_extra=describe_fields, **config)


def describe_fields(schema: dict[str, Any], cls: type) -> None:
    """pydantic's ``json_schema_extra`` hook of a documented class: each property of ``cls``'s schema whose field has
    a doc string gets it as its ``description`` (a field's own ``Field(description=...)`` is left as it is)."""
    declared = getattr(cls, "__pydantic_fields__", {})
    for name, prop in schema.get("properties", {}).items():
        doc = field_doc(cls, name)
        given = declared.get(name)
        if doc is not None and (given is None or given.description is None):
            prop["description"] = doc


def field_help(cls: type, name: str) -> str:
    """:func:`field_doc` on one line (each run of whitespace a space), as a flag's help and a field table give it;
    empty when there is none."""
    return " ".join((field_doc(cls, name) or "").split())


def field_doc(cls: type, name: str) -> str | None:
    """The doc string of ``cls``'s field ``name``, from the nearest class of ``cls.__mro__`` that annotates it;
    None when that class gives it none."""
    for owner in cls.__mro__:
        if name in inspect.get_annotations(owner):
            return _module_docs(owner.__module__).get(owner.__qualname__, {}).get(name)
    return None


@functools.cache
def _module_docs(module: str) -> dict[str, dict[str, str]]:
    """Qualified name -> {attribute -> doc string} of every class defined in the module ``module`` (its source
    parsed once)."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    return {qualname: _attribute_docs(node.body) for qualname, node in _classes(tree, "")}


def _classes(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.ClassDef]]:
    """Every class statement under ``node`` with its ``__qualname__`` (``Outer.Inner``, ``f.<locals>.C``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            yield prefix + child.name, child
            yield from _classes(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _classes(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.stmt | ast.excepthandler):  # if, try, with: the same scope
            yield from _classes(child, prefix)


def _attribute_docs(body: list[ast.stmt]) -> dict[str, str]:
    """``{name: doc}`` of a class body: each string statement right after an annotated ``name: ...``."""
    docs = {}
    for statement, after in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(after.value.value)
    return docs
