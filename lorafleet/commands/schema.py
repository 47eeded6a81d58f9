"""``lorafleet schema [KIND]``: the JSON Schema of one of lorafleet's files, generated from its typed models.

``KIND`` names the file (:data:`SCHEMAS`); the default is ``workload``. The workload's schema is
:meth:`WorkloadSpec.model_json_schema` with what the models accept before their fields are read
added: the ``defaults:`` mapping (any task key, merged under every task), tasks needing only a
``name`` (``batch_size`` and ``context_length`` may come from a preset or the defaults) and YAML's
bare ``on``/``off`` for ``recompute``. Editors use it to complete and check workload files;
``lorafleet validate`` remains the full check (presets, exactly one length mode, ...).
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from typing import Any

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("schema", help="print the JSON Schema of a lorafleet file (default: workload)")
    parser.add_argument(
        "kind", nargs="?", default="workload", choices=sorted(SCHEMAS), help="which file (default workload)"
    )
    parser.add_argument("--output", metavar="FILE", help="write the schema to FILE instead of stdout")
    parser.set_defaults(func=run)


def workload_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a workload file as written (before ``defaults`` are merged)."""
    from lorafleet.specs.workload import WorkloadSpec

    schema = WorkloadSpec.model_json_schema()
    defs = schema["$defs"]
    task = defs["TaskSpec"]
    task["required"] = ["name"]
    task["description"] += (
        " batch_size and context_length are required unless the task's preset or the workload's defaults give them."
    )
    props = schema["properties"]
    recompute = props["recompute"]
    ref = {"$ref": recompute.pop("$ref")}
    recompute["anyOf"] = [ref, {"type": "boolean", "description": "YAML's bare on/off"}]
    defaults = {
        "type": "object",
        "additionalProperties": False,
        "properties": copy.deepcopy(task["properties"]),
        "description": "Any task key but name, merged under every task's own keys (nested mappings key by key).",
    }
    del defaults["properties"]["name"]
    for field in defaults["properties"].values():
        field.pop("default", None)  # a default of defaults would read as a value every task gets
    tasks = props.pop("tasks")
    schema["properties"] = {**props, "defaults": defaults, "tasks": tasks}
    return {"$schema": SCHEMA_DIALECT, **schema, "title": "lorafleet workload"}


def _plan() -> dict[str, Any]:
    from lorafleet.plans import plan_json_schema

    return {"$schema": SCHEMA_DIALECT, **plan_json_schema(), "title": "lorafleet deployment plan"}


def _policy() -> dict[str, Any]:
    from lorafleet.specs.dispatch import policy_json_schema

    return {"$schema": SCHEMA_DIALECT, **policy_json_schema(), "title": "lorafleet dispatch policy"}


def _run() -> dict[str, Any]:
    from lorafleet.train.run_file import run_json_schema

    return {"$schema": SCHEMA_DIALECT, **run_json_schema(), "title": "lorafleet run file"}


SCHEMAS: dict[str, Callable[[], dict[str, Any]]] = {
    "workload": workload_json_schema,
    "plan": _plan,
    "policy": _policy,
    "run": _run,
}
"""File kind -> its JSON Schema (draft 2020-12), each generated from the models that read the file."""


def run(args: argparse.Namespace) -> int:
    text = json.dumps(SCHEMAS[args.kind](), indent=2) + "\n"
    if args.output:
        from lorafleet.specs.io import check_writable, write_text_atomic

        check_writable(args.output)
        write_text_atomic(args.output, text)
    else:
        print(text, end="")
    return 0
