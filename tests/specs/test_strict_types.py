"""Strict whole numbers and switches in every file lorafleet reads (#25): ``nodes: true`` was 1 node.

A file read as Python values (a workload or trace in YAML, a queue request, the task ledger, the pending
changes) gets its strictness from its field types (``specs._base``: ``Int``, ``Bool``, ``Float``); a file
lorafleet writes and reads back as JSON (a plan, its policy, a run file, a profile) is validated in strict
JSON mode (``specs.typed``). ``2.0`` is not a whole number in either.
"""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter

from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.specs import _base
from lorafleet.specs.workload import WorkloadSpec
from lorafleet.train.queue.ledger import LedgerFile
from lorafleet.train.queue.pending import Pending
from lorafleet.train.queue.requests import AddRequestFile, StopRequestFile, UpdateRequestFile
from tests.helpers.repo import SMALL_WORKLOAD

PYTHON_READ = {
    "workload": WorkloadSpec,
    "request": AddRequestFile | UpdateRequestFile | StopRequestFile,
    "ledger": LedgerFile,
    "pending": Pending,
}
GUARDS = {_base._not_a_boolean, _base._not_a_boolean_key}


def lax_leaves(node, guarded: bool = False) -> list[str]:
    """The int, bool and float leaves of a pydantic core schema that lax mode would coerce into: not strict and
    not under one of ``specs._base``'s before-validators. ``json-or-python`` (a ``JsonValue``: a revision's
    before and after, any JSON value by design) is not walked."""
    found: list[str] = []
    if isinstance(node, list):
        for item in node:
            found += lax_leaves(item, guarded)
    elif isinstance(node, dict) and node.get("type") != "json-or-python":
        if node.get("type") in ("int", "bool", "float") and not node.get("strict") and not guarded:
            found.append(node["type"])
        guard = node.get("type") == "function-before" and node.get("function", {}).get("function") in GUARDS
        for key, value in node.items():
            found += lax_leaves(value, guard and key == "schema")
    return found


def test_the_walk_finds_a_lax_number():
    class Lax(BaseModel):
        n: int
        on: bool
        x: float

    assert lax_leaves(TypeAdapter(Lax).core_schema) == ["int", "bool", "float"]


@pytest.mark.parametrize("kind", sorted(PYTHON_READ))
def test_every_number_and_switch_of_a_file_read_as_python_is_strict(kind):
    assert lax_leaves(TypeAdapter(PYTHON_READ[kind]).core_schema) == []


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda w: w["cluster"].update(nodes=True), "cluster.nodes: must be a whole number, got a boolean True"),
        (lambda w: w["cluster"].update(nodes=2.0), "cluster.nodes: must be a whole number, got a number 2.0"),
        (lambda w: w["tasks"][0].update(batch_size="48"), "batch_size: must be a whole number, got a string '48'"),
        (lambda w: w["tasks"][0].update(lora={"use_rslora": 1}), "lora.use_rslora: must be true or false"),
        (lambda w: w["tasks"][0].update(optimizer={"lr": True}), "optimizer.lr: Input should be a valid number"),
        (lambda w: w.update(seed=False), "seed: must be a whole number, got a boolean False"),
    ],
)
def test_a_workload_refuses_a_boolean_or_a_fraction_for_a_whole_number(tmp_path, capsys, edit, words):
    raw = json.loads(json.dumps(SMALL_WORKLOAD))
    edit(raw)
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err


@pytest.mark.parametrize("value", ["true", "2.0", '"2"'])
def test_a_set_refuses_a_boolean_or_a_fraction_for_a_whole_number(tmp_path, capsys, value):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(SMALL_WORKLOAD))
    assert main(["validate", str(path), "--set", f"cluster.nodes={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--set cluster.nodes: must be a whole number" in err, err


def test_numbers_still_read_as_numbers():
    """An integer is a number (``lr: 1``), and a histogram's lengths may be strings of digits (JSON keys are)."""
    spec = WorkloadSpec.model_validate(
        {
            "tasks": [
                {"name": "a", "lengths": {"histogram": {"100": 1, 200: 2.5}}, "batch_size": 2, "context_length": 512}
            ],
            "defaults": {"optimizer": {"lr": 1}},
        }
    )
    assert spec.tasks[0].lengths.histogram == {100: 1.0, 200: 2.5} and spec.tasks[0].optimizer.lr == 1.0
    with pytest.raises(ValueError, match="valid integer"):
        WorkloadSpec.model_validate(
            {"tasks": [{"name": "a", "lengths": {"histogram": {True: 1}}, "batch_size": 2, "context_length": 512}]}
        )


def test_a_profile_refuses_a_boolean_for_a_whole_number(tmp_path):
    from lorafleet.costmodel.adapters import AdapterLoad
    from lorafleet.costmodel.build import analytic_profile
    from lorafleet.costmodel.profile_format import read_profile, write_profile
    from lorafleet.specs.cluster import ClusterSpec
    from lorafleet.specs.model import MODEL_PRESETS

    path = tmp_path / "p.json"
    cluster = ClusterSpec(gpu="cpu", gpus_per_node=2)
    write_profile(analytic_profile(MODEL_PRESETS["tiny-llama"], cluster, AdapterLoad.uniform(3, 8)), path)
    raw = json.loads(path.read_text())
    raw["memory"][0]["max_tokens"] = float(raw["memory"][0]["max_tokens"])
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=r"memory\[0\].max_tokens: must be a whole number, got a number"):
        read_profile(path)
