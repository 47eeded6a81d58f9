"""``lorafleet schema [KIND]``: the JSON Schema of one of lorafleet's files, generated from its typed models.

``KIND`` names the file (:data:`SCHEMAS`); the default is ``workload``. The workload's schema is
:meth:`WorkloadSpec.model_json_schema` with what the models accept before their fields are read
added: the ``defaults:`` mapping (any task key, merged under every task), tasks needing only a
``name`` (``batch_size`` and ``context_length`` may come from a preset or the defaults), YAML's
bare ``on``/``off`` for ``recompute`` and a ``cluster`` of one pool written flat. Editors use it to
complete and check workload files; ``lorafleet validate`` remains the full check (presets, exactly
one length mode, ...).

The live task queue's files (``lorafleet.train.queue``) have theirs: ``request`` (a request file: a task
to add, an update, a finish or a cancel), ``ledger`` (a run's ``tasks.json``) and ``pending`` (a queue's
``.apply.json``), each generated from the models that read the file back.
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
    task = schema["$defs"]["TaskSpec"]
    _as_written(task)
    _with_sweep(schema, task)
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
    props["cluster"] = cluster_json_schema(props["cluster"], schema["$defs"]["PoolSpec"])
    tasks = props.pop("tasks")
    schema["properties"] = {**props, "defaults": defaults, "tasks": tasks}
    return _titled(schema, "lorafleet workload")


def _with_sweep(schema: dict[str, Any], task: dict[str, Any]) -> None:
    """A task as written carries its ``sweep`` (``specs.sweep``), never the ``member_of`` its expansion sets."""
    from lorafleet.specs.sweep import SweepSpec

    sweep = SweepSpec.model_json_schema(ref_template="#/$defs/{model}")
    schema["$defs"].update(sweep.pop("$defs", {}))
    schema["$defs"]["SweepSpec"] = sweep
    task["properties"].pop("member_of", None)
    task["properties"]["sweep"] = {"$ref": "#/$defs/SweepSpec", "description": "A hyperparameter sweep (specs.sweep)."}
    schema["$defs"].pop("SweepMembership", None)


def cluster_json_schema(pools_form: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    """A ``cluster`` as a file writes it: its pools, or its one pool's keys written flat (the shorthand)."""
    from lorafleet.specs.cluster import SHORTHAND_KEYS

    pools_form = {**pools_form, "required": ["pools"]}
    pools_form.pop("default", None)
    flat = {
        "type": "object",
        "additionalProperties": False,
        "properties": {k: copy.deepcopy(pool["properties"][k]) for k in SHORTHAND_KEYS},
        "description": "One pool, unnamed, written flat.",
    }
    return {"description": pools_form.pop("description", ""), "anyOf": [flat, pools_form]}


def request_json_schema() -> dict[str, Any]:
    """A queue request file: one of a task to add (a task as a workload writes it, over the workload's
    ``defaults``, with ``action: add`` and ``at_step``), an update, or a finish/cancel."""
    from pydantic import TypeAdapter

    from lorafleet.train.queue.requests import AddRequestFile, StopRequestFile, UpdateRequestFile

    schema = TypeAdapter(AddRequestFile | UpdateRequestFile | StopRequestFile).json_schema()
    _as_written(schema["$defs"]["AddRequestFile"])
    return _titled(schema, "lorafleet queue request")


def ledger_json_schema() -> dict[str, Any]:
    """A run's task ledger, ``<out>/tasks.json``."""
    from lorafleet.train.queue.ledger import LedgerFile

    return _titled(LedgerFile.model_json_schema(), "lorafleet task ledger")


def pending_json_schema() -> dict[str, Any]:
    """A queue's pending changes, ``<queue>/.apply.json``."""
    from lorafleet.train.queue.pending import PENDING_FILE

    return _titled(PENDING_FILE.json_schema(), "lorafleet pending queue changes")


def _as_written(task: dict[str, Any]) -> None:
    """A task's schema as a file writes it: only ``name`` is required."""
    task["required"] = ["name"]
    task["description"] += (
        " batch_size and context_length are required unless the task's preset or the workload's defaults give them."
    )


def _titled(schema: dict[str, Any], title: str) -> dict[str, Any]:
    return {"$schema": SCHEMA_DIALECT, **schema, "title": title}


def _plan() -> dict[str, Any]:
    from lorafleet.plans import plan_json_schema

    return _titled(plan_json_schema(), "lorafleet deployment plan")


def _policy() -> dict[str, Any]:
    from lorafleet.specs.dispatch import policy_json_schema

    return _titled(policy_json_schema(), "lorafleet dispatch policy")


def _run() -> dict[str, Any]:
    from lorafleet.train.run_file import run_json_schema

    return _titled(run_json_schema(), "lorafleet run file")


def _changes() -> dict[str, Any]:
    from lorafleet.train.change_log import CHANGE_RECORD

    return _titled(CHANGE_RECORD.json_schema(mode="serialization"), "lorafleet change record (a row of changes.jsonl)")


SCHEMAS: dict[str, Callable[[], dict[str, Any]]] = {
    "workload": workload_json_schema,
    "plan": _plan,
    "policy": _policy,
    "run": _run,
    "request": request_json_schema,
    "ledger": ledger_json_schema,
    "pending": pending_json_schema,
    "changes": _changes,
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
