"""A field's doc string read when asked for (``specs.field_docs``): pydantic's rule, the same JSON Schemas as
pydantic's ``use_attribute_docstrings`` for every kind of documented class, and no class's source read as the
plan command's modules are imported."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, with_config
from typing_extensions import TypedDict

from lorafleet.specs.field_docs import documented, field_doc, field_help


def kinds(config: ConfigDict) -> dict[str, Any]:
    """The same documented classes of every kind pydantic reads, under ``config``."""

    class Base(BaseModel):
        model_config = config

        a: int = 1
        """An inherited field:
            its doc string cleaned."""
        b: str = ""

    class Model(Base):
        c: float = 0.5
        """A field of its own."""
        d: int = Field(default=0, description="given to Field, not the doc string")
        """the doc string a Field's description wins over"""
        e: Base | None = None
        """A field holding a model (a $ref)."""

    @pydantic.dataclasses.dataclass(config=config)
    class PydanticDataclass:
        x: int
        """x's doc string"""
        y: int = 2

    @dataclasses.dataclass
    class StdlibDataclass:
        __pydantic_config__ = config

        z: tuple[int, ...] = ()
        """z's doc string"""
        plain = "a string after a plain assignment"
        """is no field's doc string"""

    @with_config(config)
    class Typed(TypedDict):
        t: int
        """t's doc string"""

    return {"model": Model, "pydantic": PydanticDataclass, "stdlib": StdlibDataclass, "typed": Typed}


def test_the_schemas_are_pydantics_own():
    """Every kind's JSON Schema is the one pydantic's ``use_attribute_docstrings`` gives, byte for byte."""
    ours = kinds(documented(extra="forbid"))
    theirs = kinds(ConfigDict(extra="forbid", use_attribute_docstrings=True))
    for kind, cls in ours.items():
        schema = TypeAdapter(cls).json_schema()
        assert schema == TypeAdapter(theirs[kind]).json_schema(), kind
        assert str(schema) == str(TypeAdapter(theirs[kind]).json_schema()), kind  # the keys' order too
    model = TypeAdapter(ours["model"]).json_schema()
    props = model["properties"]
    assert props["a"]["description"] == "An inherited field:\nits doc string cleaned."
    assert props["d"]["description"] == "given to Field, not the doc string"
    assert "description" not in props["b"]
    assert props["e"]["description"] == "A field holding a model (a $ref)."


def test_the_rule():
    """A string right after an annotated assignment; an inherited field's from the class that declares it (a
    dataclass's too, where pydantic's rule reads only the class's own body); None for none."""
    classes = kinds(documented())

    @dataclasses.dataclass
    class Derived(classes["stdlib"]):
        w: int = 0
        """w's doc string"""

    assert field_doc(classes["model"], "a") == "An inherited field:\nits doc string cleaned."
    assert field_help(classes["model"], "a") == "An inherited field: its doc string cleaned."
    assert field_doc(classes["model"], "b") is None and field_help(classes["model"], "b") == ""
    assert field_doc(Derived, "z") == "z's doc string" and field_doc(Derived, "w") == "w's doc string"
    assert field_doc(classes["stdlib"], "plain") is None
    assert field_doc(classes["typed"], "t") == "t's doc string"


def test_no_source_is_read_at_import():
    """Importing the plan command and every documented model reads no class's source, neither pydantic's
    extraction nor ours, and nor does a plan's policy written and read back (a count of calls, in a fresh
    process)."""
    code = textwrap.dedent(
        """
        import sys
        calls = []
        def count(frame, event, arg):
            if event == "call" and frame.f_code.co_name in ("extract_docstrings_from_cls", "_module_docs"):
                calls.append(frame.f_code.co_name)
        sys.setprofile(count)
        import lorafleet.commands.plan, lorafleet.plans, lorafleet.specs.workload, lorafleet.train.run_file
        import lorafleet.train.queue.ledger, lorafleet.train.queue.pending, lorafleet.train.change_log
        from lorafleet.specs.dispatch import DispatchPolicy
        DispatchPolicy.from_json(DispatchPolicy().to_json(), "<plan>")
        sys.setprofile(None)
        print(len(calls))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0"]
