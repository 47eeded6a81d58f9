"""The queue's typed files (``train.queue``): the task ledger, request files and the pending changes refuse
unknown keys and name the field path of a wrong value, files written before they were typed still load,
and ``lorafleet schema request|ledger|pending`` prints schemas that the files the code writes satisfy."""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml

from lorafleet.cli import main
from lorafleet.commands.schema import SCHEMAS
from lorafleet.errors import InputError
from lorafleet.specs.workload import TaskSpec
from lorafleet.train.queue.http import start_queue_server
from lorafleet.train.queue.ledger import Ledger, TaskState
from lorafleet.train.queue.pending import (
    Pending,
    PendingReplan,
    clear_pending_replan,
    load_pending,
    load_pending_replan,
    save_pending,
    save_pending_replan,
)
from lorafleet.train.queue.requests import Action, Request, RequestError
from lorafleet.train.queue.watcher import QueueWatcher, read_request
from lorafleet.turns import TaskTurns

jsonschema = pytest.importorskip("jsonschema")

DEFAULTS = {"lora": {"rank": 4, "alpha": 8}}
TASK = {"name": "code", "data": {"path": "/d.jsonl"}, "batch_size": 2, "context_length": 64}


def _spec(name: str, **kw) -> TaskSpec:
    return TaskSpec.model_validate({**TASK, "name": name, **kw})


def _ledger() -> Ledger:
    """A ledger as a run leaves it: a task added, one finished (its turns kept), one updated."""
    add = Request("a.yaml", Action.ADD, "code", task=_spec("code", lengths={"dataset": {"path": "/l.jsonl"}}))
    turns = {"chat": TaskTurns(60.0, batches=9, share=0.5, changes=((2, 0.3, None),))}
    update = Request("u.yaml", Action.UPDATE, "docs", changes={"share": 0.25, "deadline": 40})
    ledger = Ledger.of([_spec("chat"), _spec("docs", steps=10)])
    return ledger.apply([add, Request("f.yaml", Action.FINISH, "chat")], 3, turns).apply([update], 5)


def _pending() -> Pending:
    add = Request("a.yaml", Action.ADD, "code", 2, task=_spec("code"))
    return Pending(5, [add, Request("u.yaml", Action.UPDATE, "docs", changes={"share": 0.5})], {"chat": TaskTurns(9.0)})


def _edited(path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


# ---- field paths and unknown keys ------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, field, message",
    [
        (lambda raw: raw["tasks"][2]["spec"].update(batch_size=0), "tasks[2].spec.batch_size", "greater than 0"),
        (lambda raw: raw["tasks"][0].update(colour="red"), "tasks[0].colour", "Extra inputs are not permitted"),
        (lambda raw: raw["tasks"][0]["turns"].update(extra=1), "tasks[0].turns.extra", "Extra inputs"),
        (lambda raw: raw["tasks"][1]["changes"][1].__setitem__(1, "lots"), "tasks[1].changes[1][1]", "number"),
        (lambda raw: raw["tasks"][1].update(state="paused"), "tasks[1].state", "'active', 'finished'"),
        (lambda raw: raw["applied"][0].update(when="now"), "applied[0].when", "Extra inputs"),
        (lambda raw: raw.update(version=3), "version", "Extra inputs are not permitted"),
        (lambda raw: raw["tasks"][0].update(left=True), "tasks[0].left", "whole number, got a boolean True"),
        (lambda raw: raw["applied"][0].update(step=3.0), "applied[0].step", "whole number, got a number 3.0"),
    ],
)
def test_a_wrong_ledger_names_the_field(tmp_path, edit, field, message):
    _ledger().save(tmp_path)
    _edited(tmp_path / "tasks.json", edit)
    with pytest.raises(InputError, match=message) as err:
        Ledger.load(tmp_path)
    assert (err.value.path, err.value.field) == (str(tmp_path / "tasks.json"), field)


def test_a_ledger_that_is_no_object_says_so(tmp_path):
    (tmp_path / "tasks.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="not a lorafleet task ledger"):
        Ledger.load(tmp_path)


def test_a_pending_replan_round_trips_and_a_wrong_one_names_its_field(tmp_path):
    """``.replan.json``: the re-plan under way (``train.background``) a resume runs again."""
    assert load_pending_replan(tmp_path) is None
    save_pending_replan(tmp_path, PendingReplan(step=3, at=4))
    assert load_pending_replan(tmp_path) == PendingReplan(3, 4)
    _edited(tmp_path / ".replan.json", lambda raw: raw.update(at="soon"))
    with pytest.raises(InputError) as err:
        load_pending_replan(tmp_path)
    assert err.value.field == "at" and err.value.path == str(tmp_path / ".replan.json")
    clear_pending_replan(tmp_path)
    assert load_pending_replan(tmp_path) is None


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda raw: raw["requests"][0].update(surprise=1), "requests[0].surprise"),
        (lambda raw: raw["requests"][0]["task"].update(lora={"rank": 0}), "requests[0].task.lora.rank"),
        (lambda raw: raw["requests"][1].update(action="pause"), "requests[1].action"),
        (lambda raw: raw["turns"]["chat"].update(tokens="many"), "turns.chat.tokens"),
        (lambda raw: raw.pop("step"), "step"),
        (lambda raw: raw.update(step=True), "step"),
        (lambda raw: raw["turns"]["chat"].update(joined=2.0), "turns.chat.joined"),
    ],
)
def test_a_wrong_pending_file_names_the_field(tmp_path, edit, field):
    save_pending(tmp_path, _pending())
    _edited(tmp_path / ".apply.json", edit)
    with pytest.raises(InputError) as err:
        load_pending(tmp_path)
    assert err.value.field == field


@pytest.mark.parametrize(
    "text, reason",
    [
        ("name: code\ndata: {path: c.jsonl}\nbatch_size: 2\ncontext_length: 64\ncolour: red\n", "colour: Extra inputs"),
        ("name: code\ndata: {path: c.jsonl, fmt: text}\nbatch_size: 2\ncontext_length: 64\n", "data.fmt: Extra inputs"),
        ("name: code\ndata: {path: c.jsonl}\nbatch_size: 2\ncontext_length: 64\nlora: {rank: 0}\n", "lora.rank: "),
        ("action: update\nname: chat\nshare: lots\n", "share: Input should be a valid number"),
        ("action: update\nname: chat\nshare: 0.5\nsteps: 3\n", "update takes share, deadline, eval, early_stopping"),
        ("action: finish\nname: chat\ncolour: red\n", "finish takes only the task's name, got colour"),
    ],
)
def test_a_wrong_request_names_the_field_and_unknown_keys_are_refused(tmp_path, text, reason):
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(RequestError, match=reason):
        read_request(tmp_path / "r.yaml", DEFAULTS, Ledger.of([_spec("chat")]))


def test_a_rejected_requests_reason_names_the_field(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: code\ndata: {path: c.jsonl}\nbatch_size: 2\ncontext_length: 8\nlora: 4\n")
    lines: list[str] = []
    assert QueueWatcher(tmp_path, DEFAULTS, Ledger.of([_spec("chat")]), log=lines.append).poll(0) == []
    reason = (tmp_path / "rejected" / "bad.yaml.reason").read_text()
    assert reason.startswith("lora: ") and lines == [f"rejected bad.yaml: {reason.strip()}"]


# ---- files written before they were typed ----------------------------------------------------------

OLD_LEDGER = {
    "applied": [{"action": "finish", "file": "f.yaml", "name": "chat", "step": 3}],
    "tasks": [
        {
            "changes": [],
            "left": 3,
            "spec": {**TASK, "name": "chat", "data": {"format": "auto", "path": "/d.jsonl"}, "start_step": 0},
            "state": "finished",
            "turns": {
                "batches": 9,
                "changes": [[2, 0.3, None]],
                "deadline": None,
                "joined": 0,
                "share": 0.5,
                "tokens": 60.0,
                "until": 3,
            },
        },
        {
            "changes": [[0, None, None], [2, 0.25, None]],
            "left": None,
            "spec": {**TASK, "name": "docs", "share": 0.25, "start_step": 0},
            "state": "active",
            "turns": None,
        },
    ],
}
OLD_PENDING = {
    "requests": [
        {
            "action": "add",
            "at_step": 0,
            "changes": {},
            "file": "a.yaml",
            "name": "code",
            "task": {**TASK, "steps": None},
        },
        {"action": "update", "at_step": 4, "changes": {"share": 0.25}, "file": "u.yaml", "name": "docs", "task": None},
    ],
    "step": 5,
    "turns": {"chat": {**OLD_LEDGER["tasks"][0]["turns"], "until": None}},
}


def test_files_written_by_the_untyped_queue_still_load(tmp_path):
    (tmp_path / "tasks.json").write_text(json.dumps(OLD_LEDGER, indent=2))
    ledger = Ledger.load(tmp_path)
    assert [(e.spec.name, e.state, e.left) for e in ledger.entries] == [
        ("chat", TaskState.FINISHED, 3),
        ("docs", TaskState.ACTIVE, None),
    ]
    assert ledger.departed() == (TaskTurns(60.0, batches=9, until=3, share=0.5, changes=((2, 0.3, None),)),)
    assert ledger.turn_changes() == {"docs": ((0, None, None), (2, 0.25, None))}
    assert ledger.applied[0]["action"] is Action.FINISH
    (tmp_path / ".apply.json").write_text(json.dumps(OLD_PENDING, indent=2))
    pending = load_pending(tmp_path)
    assert pending.step == 5 and pending.requests[0].task == _spec("code")
    assert pending.requests[1] == Request("u.yaml", Action.UPDATE, "docs", 4, changes={"share": 0.25})
    assert pending.turns == {"chat": TaskTurns(60.0, batches=9, share=0.5, changes=((2, 0.3, None),))}


# ---- lorafleet schema ------------------------------------------------------------------------------


def _schema(kind: str, capsys) -> jsonschema.Draft202012Validator:
    assert main(["schema", kind]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == SCHEMAS[kind]() and schema["$schema"].endswith("2020-12/schema")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_ledger_and_pending_files_the_code_writes_satisfy_their_schemas(tmp_path, capsys):
    _ledger().save(tmp_path)
    save_pending(tmp_path, _pending())
    ledger = json.loads((tmp_path / "tasks.json").read_text())
    pending = json.loads((tmp_path / ".apply.json").read_text())
    ledger_schema, pending_schema = _schema("ledger", capsys), _schema("pending", capsys)
    ledger_schema.validate(ledger)
    ledger_schema.validate(OLD_LEDGER)
    pending_schema.validate(pending)
    pending_schema.validate(OLD_PENDING)
    ledger["tasks"][0]["colour"] = "red"
    pending["requests"][0]["surprise"] = 1
    assert not ledger_schema.is_valid(ledger) and not pending_schema.is_valid(pending)


def test_request_files_satisfy_the_request_schema(tmp_path, capsys):
    validator = _schema("request", capsys)
    with start_queue_server(tmp_path / "queue", tmp_path) as server:  # the HTTP front-end writes request files
        for method, path, body in (
            ("POST", "/v1/tasks", {**TASK, "at_step": 5, "share": 0.25}),
            ("POST", "/v1/tasks", {"name": "lean", "data": {"path": "x.jsonl"}}),  # the rest from the defaults
            ("DELETE", "/v1/tasks/chat?mode=finish", None),
            ("DELETE", "/v1/tasks/chat", None),
            ("PATCH", "/v1/tasks/docs", {"deadline": 80}),
        ):
            data = None if body is None else json.dumps(body).encode()
            call = urllib.request.Request(server.url + path, data=data, method=method)
            call.add_header("Authorization", f"Bearer {server.token}")
            with urllib.request.urlopen(call, timeout=5) as response:
                written = tmp_path / "queue" / json.loads(response.read())["file"]
            validator.validate(json.loads(written.read_text()))
    for text in ("name: code\ndata: {path: c.jsonl}\nat_step: 3\n", "{action: update, name: chat, share: 0.5}"):
        validator.validate(yaml.safe_load(text))
    wrong = ({"action": "pause", "name": "chat"}, {"action": "cancel", "name": "chat", "share": 1}, {**TASK, "x": 1})
    assert not any(validator.is_valid(request) for request in wrong)
