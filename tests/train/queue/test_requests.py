"""The queue's parts without a run: request files (``train.queue``), the task ledger, each task's turns
(``lorafleet.turns``) and the streams that follow them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import TypeAdapter

from lorafleet.errors import InputError
from lorafleet.runtime.data_stream import DataStreams
from lorafleet.specs.workload import TaskSpec
from lorafleet.train.queue import (
    Action,
    Ledger,
    Pending,
    QueueWatcher,
    Request,
    RequestError,
    TaskState,
    load_pending,
    read_request,
    save_pending,
)
from lorafleet.turns import TaskTurns, last_step, turns
from tests.helpers.fleet_harness import synthetic_task

DEFAULTS = {"lora": {"rank": 4, "alpha": 8}, "optimizer": {"lr": 1e-3}}


def _spec(name: str, **kw) -> TaskSpec:
    return TaskSpec.model_validate(
        {"name": name, "data": {"path": "/d.jsonl"}, "batch_size": 2, "context_length": 64, **kw}
    )


LEDGER = Ledger.of([_spec("chat"), _spec("docs")])
WITH_EVAL = Ledger.of([*LEDGER.active, _spec("evald", eval={"split": 0.1, "every_steps": 10})])
"""The requests' ledger: and a task evaluated every 10 steps."""


def _request(tmp_path, text: str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return read_request(path, DEFAULTS, WITH_EVAL)


def test_an_added_task_takes_the_workloads_defaults_and_paths_relative_to_its_file(tmp_path):
    r = _request(tmp_path, "name: code\ndata: {path: code.jsonl}\nbatch_size: 4\ncontext_length: 128\nat_step: 3\n")
    assert (r.action, r.name, r.at_step) == (Action.ADD, "code", 3)
    assert r.task.lora.rank == 4 and r.task.optimizer.lr == 1e-3
    assert r.task.data.path == str(tmp_path / "code.jsonl")
    assert TypeAdapter(Request).validate_json(TypeAdapter(Request).dump_json(r)) == r


@pytest.mark.parametrize(
    "text, reason",
    [
        ("name: [x\n", "malformed YAML"),
        ("- a\n", "expected a mapping, got list"),
        ("action: pause\nname: chat\n", "action must be one of add, finish, cancel, update"),
        ("name: code\nat_step: -1\n", "at_step must be a whole number >= 0"),
        ("batch_size: 2\n", "needs the task's name"),
        ("name: chat\ndata: {path: c.jsonl}\nbatch_size: 2\ncontext_length: 64\n", "already in this run"),
        ("name: code\ndata: {path: c.jsonl}\nbatch_size: 0\ncontext_length: 64\n", "batch_size"),
        ("name: code\nlengths: {values: [30, 40]}\nbatch_size: 2\ncontext_length: 64\n", "data: training needs data"),
        ("action: finish\nname: nobody\n", "no active task 'nobody'"),
        ("action: cancel\nname: chat\nshare: 0.5\n", "cancel takes only the task's name"),
        ("action: update\nname: chat\n", "update takes share, deadline, eval, early_stopping"),
        ("action: update\nname: chat\nshare: 1.5\n", "share"),
        ("action: update\nname: chat\ndeadline: 5\n", "a deadline needs steps"),
        ("action: update\nname: chat\neval: {every_steps: 5}\n", "the task has no eval"),
        ("action: update\nname: chat\nearly_stopping: {patience: 2}\n", "early stopping needs an eval"),
        ("action: update\nname: evald\neval: {split: 0.2}\n", "changes every_steps only"),
        ("action: update\nname: evald\neval: {every_steps: 0}\n", "every_steps"),
    ],
)
def test_a_malformed_request_says_why_in_one_line(tmp_path, text, reason):
    with pytest.raises(RequestError, match=reason) as err:
        _request(tmp_path, text)
    assert "\n" not in str(err.value)


def test_a_json_request_and_an_update(tmp_path):
    r = _request(tmp_path, json.dumps({"action": "update", "name": "docs", "share": 0.25}), "u.json")
    assert (r.action, dict(r.changes)) == (Action.UPDATE, {"share": 0.25})
    assert LEDGER.apply([r], 4).active[1].share == 0.25


def test_an_update_changes_the_evaluation_cadence_and_early_stopping(tmp_path):
    text = "action: update\nname: evald\neval: {every_steps: 4}\nearly_stopping: {patience: 2}\n"
    r = _request(tmp_path, text)
    evald = WITH_EVAL.apply([r], 6).active[2]
    assert (evald.eval.every_steps, evald.eval.split, evald.early_stopping.patience) == (4, 0.1, 2)
    off = _request(tmp_path, "action: update\nname: evald\nearly_stopping: null\n", "off.yaml")
    assert WITH_EVAL.apply([r], 6).apply([off], 8).active[2].early_stopping is None
    assert TypeAdapter(Request).validate_json(TypeAdapter(Request).dump_json(r)) == r  # as .apply.json holds it


def test_the_watcher_waits_for_at_step_accepts_what_is_due_and_rejects_the_rest(tmp_path):
    queue = tmp_path / "queue"
    queue.mkdir()
    (queue / "a-later.yaml").write_text(
        "name: code\ndata: {path: c.jsonl}\nbatch_size: 2\ncontext_length: 64\nat_step: 5\n"
    )
    (queue / "b-now.yaml").write_text("action: finish\nname: chat\n")
    (queue / "c-bad.yaml").write_text("name: [\n")
    (queue / "d-dataless.yaml").write_text("name: big\ndata: {path: big.jsonl}\nbatch_size: 2\ncontext_length: 64\n")
    (queue / ".staged.yaml").write_text("name: [\n")  # a writer's temporary file: not read
    (queue / "notes.txt").write_text("not a request")
    lines = []

    def check(task: TaskSpec) -> None:
        if task.name == "big":
            raise InputError(task.data.path, "", "no such file")

    watcher = QueueWatcher(queue, DEFAULTS, LEDGER, check=check, log=lines.append)
    due = watcher.poll(2)
    assert [r.file for r in due] == ["b-now.yaml"] and watcher.next_due() == 5
    assert sorted(p.name for p in (queue / "accepted").iterdir()) == ["b-now.yaml"]
    assert sorted(p.name for p in (queue / "rejected").iterdir()) == [
        "c-bad.yaml",
        "c-bad.yaml.reason",
        "d-dataless.yaml",
        "d-dataless.yaml.reason",
    ]
    assert "no such file" in (queue / "rejected" / "d-dataless.yaml.reason").read_text()
    assert len(lines) == 2 and lines[0].startswith("rejected c-bad.yaml: malformed YAML")
    assert watcher.poll(4) == [] and [r.name for r in watcher.poll(5)] == ["code"]
    assert watcher.next_due() is None and (queue / ".staged.yaml").exists() and (queue / "notes.txt").exists()


def test_a_queued_tasks_data_must_resolve_inside_the_data_roots_before_it_is_read(tmp_path):
    """``--queue-data-root`` (#25): a task whose data path, or the file a symlink leads to, is outside every root
    is rejected with a reason that names the path as given, and its data is never read (the check that
    tokenizes it is not called); the queue's folders and reasons are private to the run's user."""
    import os
    import stat

    from lorafleet.train.queue import data_roots

    root, secret, queue = tmp_path / "data", tmp_path / "secret", tmp_path / "queue"
    for folder in (root, secret, queue):
        folder.mkdir()
    (root / "ok.jsonl").write_text("{}\n")
    (secret / "keys.jsonl").write_text("{}\n")
    (root / "link.jsonl").symlink_to(secret / "keys.jsonl")
    (root / "sub").symlink_to(secret)
    task = "batch_size: 2\ncontext_length: 64\n"
    (queue / "a-in.yaml").write_text(f"name: a\ndata: {{path: {root / 'ok.jsonl'}}}\n{task}")
    (queue / "b-out.yaml").write_text(f"name: b\ndata: {{path: {secret / 'keys.jsonl'}}}\n{task}")
    (queue / "c-link.yaml").write_text(f"name: c\ndata: {{path: {root / 'link.jsonl'}}}\n{task}")
    (queue / "d-dir.yaml").write_text(f"name: d\ndata: {{path: {root / 'sub' / 'keys.jsonl'}}}\n{task}")
    (queue / "e-up.yaml").write_text(f"name: e\ndata: {{path: ../secret/keys.jsonl}}\n{task}")
    (queue / "f-lengths.yaml").write_text(
        f"name: f\ndata: {{path: {root / 'ok.jsonl'}}}\nlengths: {{dataset: {{path: {secret}}}}}\n{task}"
    )
    checked: list[str] = []
    roots = data_roots([_spec("chat", data={"path": str(root / "chat.jsonl")})])
    assert roots == (os.path.realpath(root),)
    watcher = QueueWatcher(queue, DEFAULTS, LEDGER, check=lambda t: checked.append(t.name), data_roots=roots)
    assert [r.name for r in watcher.poll(0)] == ["a"] and checked == ["a"]
    rejected = queue / "rejected"
    for name, path in (("b-out", secret / "keys.jsonl"), ("c-link", root / "link.jsonl")):
        reason = (rejected / f"{name}.yaml.reason").read_text()
        assert reason == f"data: {path} is outside the folders this run takes data from (--queue-data-root)\n"
    assert "lengths.dataset: " in (rejected / "f-lengths.yaml.reason").read_text()
    assert str(secret / "keys.jsonl") not in (rejected / "c-link.yaml.reason").read_text()  # not where it leads
    assert sorted(p.name for p in rejected.glob("*.reason")) == [
        "b-out.yaml.reason",
        "c-link.yaml.reason",
        "d-dir.yaml.reason",
        "e-up.yaml.reason",
        "f-lengths.yaml.reason",
    ]
    assert stat.S_IMODE(rejected.stat().st_mode) == 0o700 and stat.S_IMODE((queue / "accepted").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in rejected.glob("*.reason")} == {0o600}


def test_the_ledger_records_joins_and_departures_and_round_trips(tmp_path):
    add = Request("a.yaml", Action.ADD, "code", task=_spec("code"))
    ledger = LEDGER.apply([add, Request("f.yaml", Action.FINISH, "chat")], 3).apply(
        [Request("c.yaml", Action.CANCEL, "code")], 6
    )
    assert [(e.spec.name, e.state, e.spec.start_step, e.left) for e in ledger.entries] == [
        ("chat", TaskState.FINISHED, 0, 3),
        ("docs", TaskState.ACTIVE, 0, None),
        ("code", TaskState.CANCELLED, 3, 6),
    ]
    assert [t.name for t in ledger.active] == ["docs"] and [a["step"] for a in ledger.applied] == [3, 3, 6]
    ledger.save(tmp_path)
    assert Ledger.load(tmp_path) == ledger
    pending = Pending(3, [add], {"chat": TaskTurns(60.0, batches=9, share=0.5, changes=((2, 0.3, None),))})
    save_pending(tmp_path / "q", pending)
    assert load_pending(tmp_path / "q") == pending
    (tmp_path / "tasks.json").write_text("{not json")
    with pytest.raises(InputError, match="not a lorafleet task ledger"):
        Ledger.load(tmp_path)


# ---- turns ----------------------------------------------------------------------------------------


def test_by_default_every_task_takes_part_in_every_step_from_its_start_to_its_end():
    took = turns([TaskTurns(10.0), TaskTurns(10.0, batches=3, joined=2), TaskTurns(10.0, until=4)], 8)
    assert took[:, 0].all()
    assert took[:, 1].tolist() == [False, False, True, True, True, False, False, False]
    assert took[:, 2].tolist() == [True] * 4 + [False] * 4
    assert last_step([TaskTurns(1.0, batches=3, joined=2)], 20) == 5


@pytest.mark.parametrize(
    "tasks",
    [
        [TaskTurns(1.0, batches=3, joined=2), TaskTurns(2.0, until=7)],
        [TaskTurns(400.0, batches=40), TaskTurns(300.0, batches=6, share=0.05), TaskTurns(100.0, share=0.2, until=33)],
        [TaskTurns(300.0, batches=10, share=0.01, deadline=50), TaskTurns(5.0, batches=2, joined=60)],
        [TaskTurns(1.0, batches=0), TaskTurns(1.0, until=0)],
    ],
)
def test_the_last_step_is_drawn_a_block_at_a_time_and_never_for_the_whole_horizon(monkeypatch, tasks):
    """``--steps 1000000000000`` drew a (steps, tasks) array of the whole run (1.82 TiB, #25): the last step
    is now found a block at a time (a block of 4 here, to cross block edges), equal to the whole draw's, and
    a horizon of 10^12 draws only until every task has ended (counted: the rows drawn)."""
    import lorafleet.turns as turns_module

    monkeypatch.setattr(turns_module, "DRAW_BLOCK", 4)
    drawn: list[int] = []
    rows = turns_module.TurnDraw.rows
    monkeypatch.setattr(turns_module.TurnDraw, "rows", lambda self, count: drawn.append(count) or rows(self, count))
    whole = turns(tasks, 100)
    expected = int(np.flatnonzero(whole.any(axis=1))[-1]) + 1 if whole.any() else 0
    drawn.clear()
    assert last_step(tasks, 100) == expected
    assert last_step(tasks, 10**12) == expected and max(drawn, default=0) <= 4 and sum(drawn) <= 2 * 100


def test_a_task_without_an_end_takes_the_whole_horizon_without_a_draw(monkeypatch):
    import lorafleet.turns as turns_module

    monkeypatch.setattr(turns_module.TurnDraw, "rows", None)  # no row may be drawn
    assert last_step([TaskTurns(1.0, batches=3), TaskTurns(2.0, share=0.1, joined=5)], 10**12) == 10**12


def test_a_share_is_the_tasks_fraction_of_the_tokens_over_many_steps():
    tasks = [TaskTurns(400.0), TaskTurns(300.0, share=0.1), TaskTurns(100.0, share=0.5)]
    took = turns(tasks, 400)
    tokens = took * np.array([t.tokens for t in tasks])
    fraction = tokens.sum(axis=0) / tokens.sum()
    assert fraction[1] == pytest.approx(0.1, abs=0.01)
    assert took[:, 2].all()  # its batch is under half the step's tokens: it is in every step
    assert took[:, 0].all()  # no share: every step


def test_a_deadline_forces_a_task_in_once_it_has_no_slack():
    slow = TaskTurns(300.0, batches=10, share=0.01, deadline=20)
    took = turns([TaskTurns(400.0), slow], 30)[:, 1]
    assert took.sum() == 10 and np.flatnonzero(took)[-1] == 19  # its last batch exactly at the deadline
    assert not took[:10].any()  # a share that small gave it no turn before its slack ran out


def test_a_step_with_eligible_tasks_is_never_empty():
    took = turns([TaskTurns(100.0, share=0.01), TaskTurns(100.0, share=0.01)], 10)
    assert took.any(axis=1).all()


def test_a_tasks_stream_is_its_own_whoever_trains_beside_it_or_joins():
    a, b = synthetic_task("a", 30, (20, 40), 0), synthetic_task("b", 30, (20, 40), 1)
    together = DataStreams([a, b], (2, 3), seed=7, joined=(0, 2))
    alone = DataStreams([b], (3,), seed=7)
    for step in range(2, 6):
        batch = together.global_batch(step)
        mine = batch.task_ids == 1
        own = alone.global_batch(step - 2)
        assert batch.sample_ids[mine].tolist() == own.sample_ids.tolist()
        assert [e.input_ids for e in together.examples(batch.task_ids[mine], batch.sample_ids[mine])] == [
            e.input_ids for e in alone.examples(own.task_ids, own.sample_ids)
        ]
    assert set(together.global_batch(1).task_ids.tolist()) == {0}
    assert together.cursors(4) == [8, 6]


def test_departures_within_the_window_of_the_first_are_applied_at_one_boundary():
    """``turns.departures``: a finished task waits for the tasks done within ``window`` steps of it (then they
    leave together), never longer; with another change at the boundary it leaves at once."""
    from lorafleet.turns import departures

    ends = {"a": 10, "b": 15, "c": 19, "d": 40}
    assert departures(ends, 9, window=8) == ([], 10)
    assert departures(ends, 10, window=8) == ([], 15)  # b is done within 8 steps of a: a waits for it
    assert departures(ends, 15, window=8) == (["a", "b"], 19)  # c (19) is more than 8 steps after a (10)
    assert departures(ends, 19, window=8) == (["a", "b", "c"], 40)  # (a and b had left: the caller's ends lack them)
    assert departures({"c": 19, "d": 40}, 19, window=8) == (["c"], 40)
    assert departures(ends, 10, now=True, window=8) == (["a"], 15)  # a change here anyway: a goes with it
    assert departures({"d": 40}, 41) == (["d"], None)


def test_a_share_changed_mid_run_leaves_the_batches_already_taken_alone():
    """An update at step 6 takes effect from step 6: the turns before it, and so the cursors a checkpoint
    at step 6 recorded, are those of the run before the update (a resume checks them)."""
    update = Request("u.yaml", Action.UPDATE, "docs", changes={"share": 0.2})
    ledger = LEDGER.apply([update], 6)
    history = ledger.turn_changes()["docs"]
    assert history == ((0, None, None), (6, 0.2, None)) and ledger.active[1].share == 0.2
    a, b = synthetic_task("chat", 30, (20, 40), 0), synthetic_task("docs", 30, (20, 40), 1)
    before = DataStreams([a, b], (2, 3), seed=7)
    after = DataStreams([a, b], (2, 3), seed=7, shares=(None, 0.2), changes=((), history))
    assert after.cursors(6) == before.cursors(6)
    took = [after.batches_taken(1, k + 1) - after.batches_taken(1, k) for k in range(6, 40)]
    assert 0 < sum(took) < 34  # from step 6 on, docs takes turns by its share


def test_the_tasks_that_stay_redraw_the_steps_before_a_departure_with_it():
    """Shares depend on every task a step took: after ``chat`` leaves at step 10, ``docs`` (share 0.3) must
    still see the first 10 steps as they were, so the ledger keeps chat's turns and the streams use them."""
    a, b = synthetic_task("chat", 30, (20, 40), 0), synthetic_task("docs", 30, (20, 40), 1)
    before = DataStreams([a, b], (4, 3), seed=7, shares=(None, 0.3))
    ledger = LEDGER.apply([Request("f.yaml", Action.FINISH, "chat")], 10, dict(zip(["chat", "docs"], before.turns)))
    assert ledger.departed()[0].until == 10 and ledger.departed()[0].tokens == before.turns[0].tokens
    after = DataStreams([b], (3,), seed=7, shares=(0.3,), departed=ledger.departed())
    assert after.cursors(10) == before.cursors(10)[1:]
    alone = DataStreams([b], (3,), seed=7, shares=(0.3,))
    assert alone.cursors(10) != before.cursors(10)[1:]  # what the resume checked against, had chat been forgotten


def test_an_added_tasks_length_dataset_path_is_relative_to_its_file_too(tmp_path):
    """A queued task's data paths follow the workload's rule: ``data.path`` and ``lengths.dataset.path``
    are both relative to the request file (the ledger keeps them absolute for every later launch)."""
    r = _request(
        tmp_path,
        "name: code\ndata: {path: code.jsonl}\nlengths: {dataset: {path: lengths.jsonl}}\n"
        "batch_size: 4\ncontext_length: 128\n",
    )
    assert r.task.data.path == str(tmp_path / "code.jsonl")
    assert r.task.lengths.dataset.path == str(tmp_path / "lengths.jsonl")


def test_a_queued_tasks_data_must_be_a_file_or_a_dataset_directory(tmp_path):
    """#38: an add whose data was a FIFO blocked rank 0 at the boundary (the check that tokenizes it opened it)
    until something opened it for writing. A data path (``data``, ``lengths.dataset``) that is neither a regular
    file nor a directory (a saved dataset) is rejected when the request is read, in one line, before the check
    that reads it is called; the run goes on and takes the good ones."""
    import os

    root, queue = tmp_path / "data", tmp_path / "queue"
    for folder in (root, queue, root / "saved"):
        folder.mkdir()
    os.mkfifo(root / "pipe.jsonl")
    (root / "ok.jsonl").write_text("{}\n")
    task = "batch_size: 2\ncontext_length: 64\n"
    (queue / "a-fifo.yaml").write_text(f"name: a\ndata: {{path: {root / 'pipe.jsonl'}}}\n{task}")
    (queue / "b-device.yaml").write_text(f"name: b\ndata: {{path: {os.devnull}}}\n{task}")
    (queue / "c-lengths.yaml").write_text(
        f"name: c\ndata: {{path: {root / 'ok.jsonl'}}}\nlengths: {{dataset: {{path: {root / 'pipe.jsonl'}}}}}\n{task}"
    )
    (queue / "d-saved.yaml").write_text(f"name: d\ndata: {{path: {root / 'saved'}}}\n{task}")
    (queue / "e-file.yaml").write_text(f"name: e\ndata: {{path: {root / 'ok.jsonl'}}}\n{task}")
    checked: list[str] = []
    roots = (os.path.realpath(root), os.path.dirname(os.path.realpath(os.devnull)))
    watcher = QueueWatcher(queue, DEFAULTS, LEDGER, check=lambda t: checked.append(t.name), data_roots=roots)
    assert [r.name for r in watcher.poll(0)] == ["d", "e"] and checked == ["d", "e"]
    reason = {p.name: p.read_text() for p in (queue / "rejected").glob("*.reason")}
    assert reason == {
        "a-fifo.yaml.reason": f"data: {root / 'pipe.jsonl'} is a FIFO, not a file or a saved dataset's directory\n",
        "b-device.yaml.reason": f"data: {os.devnull} is a character device, not a file or a saved dataset's "
        "directory\n",
        "c-lengths.yaml.reason": f"lengths.dataset: {root / 'pipe.jsonl'} is a FIFO, not a file or a saved "
        "dataset's directory\n",
    }


def _laughs(levels: int) -> str:
    """A YAML "billion laughs": each anchor a list of ten of the one before (10 ** levels values expanded)."""
    lines = ["name: code", 'l0: &l0 ["lol"]']
    lines += [f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 10)}]" for k in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "name, text, reason",
    [
        ("deep.yaml", "[" * 3000 + "]" * 3000, "nested deeper than 32 levels"),
        ("deep.json", "[" * 100_000 + "]" * 100_000, "nested deeper than 32 levels"),
        ("deep-keys.yaml", "name: code\n" + "".join(f"{'  ' * k}k:\n" for k in range(40)), "nested deeper than 32"),
        ("nested.json", '{"name": "code", "x": ' + "[" * 100 + "]" * 100 + "}", "nested deeper than 32 levels"),
        ("loop.yaml", "name: code\nloop: &a [*a]\n", "nested deeper than 32 levels"),
        ("laughs.yaml", _laughs(9), "more than 1,048,576 values"),
        ("big.json", json.dumps({"name": "code", "pad": "x" * (1 << 20)}), "over 1,048,576 bytes"),
        ("inf.json", '{"action": "update", "name": "chat", "share": 1e999}', "1e999 is not a finite number"),
        ("nan.json", '{"action": "update", "name": "chat", "share": NaN}', "NaN is not a finite number"),
        ("object.yaml", "name: !!python/object/apply:os.getcwd []\n", "malformed YAML"),
    ],
)
def test_a_request_file_is_bounded_and_parsed_safely(tmp_path, name, text, reason):
    """#38: a request nested 3,000 deep (YAML) or 100,000 deep (JSON) raised a RecursionError the watcher did
    not catch, so the run died, and died again on every restart (the file stays in the queue). A request file
    is bounded (its size, its depth, its values with YAML's aliases expanded) and parsed by a loader that
    builds no objects; anything else is a RequestError of one line, which the watcher rejects."""
    with pytest.raises(RequestError, match=reason) as err:
        _request(tmp_path, text, name)
    assert "\n" not in str(err.value)


def test_a_request_the_parser_cannot_take_is_rejected_and_the_queue_goes_on(tmp_path):
    queue = tmp_path / "queue"
    queue.mkdir()
    (queue / "a-deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (queue / "b-deep.yaml").write_text("[" * 3000 + "]" * 3000)
    (queue / "c-finish.yaml").write_text("action: finish\nname: chat\n")
    lines: list[str] = []
    watcher = QueueWatcher(queue, DEFAULTS, LEDGER, log=lines.append)
    assert [r.file for r in watcher.poll(0)] == ["c-finish.yaml"]
    assert sorted(p.name for p in (queue / "rejected").glob("*.reason")) == ["a-deep.json.reason", "b-deep.yaml.reason"]
    assert len(lines) == 2 and all("nested deeper than 32 levels" in line for line in lines)


def _add(queue, file: str, name: str, **keys) -> None:
    extra = "".join(f"{k}: {v}\n" for k, v in keys.items())
    (queue / file).write_text(f"name: {name}\ndata: {{path: d.jsonl}}\nbatch_size: 2\ncontext_length: 64\n{extra}")


def _reasons(queue) -> dict[str, str]:
    rejected = queue / "rejected"
    return (
        {p.name.removesuffix(".reason"): p.read_text() for p in rejected.glob("*.reason")} if rejected.is_dir() else {}
    )


def _watcher(queue, ledger=LEDGER, **kw) -> QueueWatcher:
    return QueueWatcher(queue, DEFAULTS, ledger, log=lambda line: None, **kw)


def test_two_adds_of_one_name_for_different_steps_take_the_first(tmp_path):
    """#38: two adds of ``code`` staged for steps 3 and 6 were both accepted (each judged when first read): the
    ledger held the task twice and the run could not be resumed. The second is judged again when due: rejected."""
    queue = tmp_path / "queue"
    queue.mkdir()
    _add(queue, "a.yaml", "code", at_step=3)
    _add(queue, "b.yaml", "code", at_step=6)
    watcher = _watcher(queue)
    assert watcher.poll(0) == []
    (first,) = watcher.poll(3)
    watcher.ledger = watcher.ledger.apply([first], 3)
    assert watcher.poll(6) == [] and "already in this run" in _reasons(queue)["b.yaml"]


def test_a_task_that_joins_at_a_boundary_cannot_leave_at_it(tmp_path):
    """#38: an add and a cancel (or finish) of one task due at one boundary crashed the export (the task was in no
    checkpoint) and wedged every resume. The leaving request is rejected; the add stands."""
    queue = tmp_path / "queue"
    queue.mkdir()
    _add(queue, "a.yaml", "code")
    (queue / "b.yaml").write_text("action: cancel\nname: code\n")
    assert [r.file for r in _watcher(queue).poll(4)] == ["a.yaml"]
    assert "joins at this step (step 4): it cannot leave at the same step" in _reasons(queue)["b.yaml"]


def test_an_add_starts_at_the_step_it_asks_for(tmp_path):
    """#38: an add's own ``start_step`` was replaced by the step it was applied at. It is the step it joins at (the
    run ends a window there); one that has passed when it comes due, or that disagrees with ``at_step``, is
    rejected in one line."""
    queue = tmp_path / "queue"
    queue.mkdir()
    _add(queue, "a.yaml", "code", start_step=5)
    _add(queue, "b.yaml", "late", start_step=1)
    _add(queue, "c.yaml", "both", start_step=5, at_step=6)
    watcher = _watcher(queue)
    assert watcher.poll(2) == [] and watcher.next_due() == 5
    assert "start_step 1 has passed: the run is at step 2" in _reasons(queue)["b.yaml"]
    assert "start_step 5 and at_step 6 disagree" in _reasons(queue)["c.yaml"]
    (due,) = watcher.poll(5)
    assert (due.name, due.at_step, due.task.start_step) == ("code", 5, 5)
    assert watcher.ledger.apply([due], 5).active[-1].start_step == 5


def test_a_deadline_that_cannot_be_met_is_refused_when_it_is_set(tmp_path):
    """#38: ``deadline: 43`` at step 13 for a task of 40 steps that had taken one batch was accepted and missed
    without a word, and so was a deadline 209 steps in the past. A task takes one batch a step at most: the
    deadline must leave room for the steps it has left from the boundary."""
    queue = tmp_path / "queue"
    queue.mkdir()
    ledger = Ledger.of([_spec("chat", steps=40), _spec("docs")])
    (queue / "a.yaml").write_text("action: update\nname: chat\ndeadline: 43\n")
    (queue / "b.yaml").write_text("action: update\nname: chat\ndeadline: 60\n")
    watcher = _watcher(queue, ledger, taken=lambda name, step: 1)
    assert [r.file for r in watcher.poll(13)] == ["b.yaml"]
    assert "deadline 43 cannot be met: chat has 39 of its 40 steps left at step 13" in _reasons(queue)["a.yaml"]
    (queue / "c.yaml").write_text("action: update\nname: chat\ndeadline: 50\n")
    assert watcher.poll(259) == [] and "deadline 50 has passed: the run is at step 259" in _reasons(queue)["c.yaml"]


def test_an_edited_waiting_request_is_read_again(tmp_path):
    """#38: an edit of a request waiting for its step was ignored (the first reading was kept)."""
    import os

    queue = tmp_path / "queue"
    queue.mkdir()
    (queue / "s.yaml").write_text("action: update\nname: chat\nshare: 0.2\nat_step: 5\n")
    lines = []
    watcher = QueueWatcher(queue, DEFAULTS, LEDGER, log=lines.append)
    assert watcher.poll(1) == []
    (queue / "s.yaml").write_text("action: update\nname: chat\nshare: 0.7\nat_step: 5\n")
    os.utime(queue / "s.yaml", ns=(0, 1_000_000_000))  # another mtime whatever the clock's resolution
    assert watcher.poll(2) == [] and lines == ["read s.yaml again: it changed while it waited for step 5"]
    (due,) = watcher.poll(5)
    assert due.changes == {"share": 0.7}
