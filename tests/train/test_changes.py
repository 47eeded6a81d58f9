"""Rank 0's fleet changes (``train.changes``) without processes: the component against a fake fleet, on the tiny
Llama's demo tasks planned as two ``<1,1>`` replicas on a 4-GPU node, and the one decision rule it shares with
``simulate --arrivals`` (``planner.decision``).

The fake fleet records what it is asked (checkpoints, changes applied); every other part is real: the queue
directory and its watcher, the ledger, the planner's re-plan, the run's files and ``changes.jsonl``."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import jsonschema
import pytest

from lorafleet.commands.schema import SCHEMAS
from lorafleet.planner.decision import HandOff, Keep, Move, ReplanNow, decide, settle
from lorafleet.plans import DeploymentPlan
from lorafleet.train.change_log import ChangeKind, Outcome, read_changes
from lorafleet.train.changes import departures_due
from lorafleet.train.options import TrainOptions
from lorafleet.train.queue import Ledger, load_pending
from lorafleet.train.running import Running, Stop
from lorafleet.work import counting
from tests.helpers.fake_fleet import due_when_ready, fleet_of
from tests.helpers.queue_fleet import add_request

STEPS = 10


@pytest.fixture
def fleet(tmp_path, tiny_tokenizer_dir):
    """(options, running, changes, fake fleet): ``tests.helpers.fake_fleet.fleet_of``."""
    return fleet_of(tmp_path, tiny_tokenizer_dir)


def _rows(options: TrainOptions) -> list:
    return read_changes(options.run_dir.changes)


def test_a_queued_add_is_tokenized_once_kept_on_the_running_deployment_and_recorded(fleet):
    """``codegen`` is added at step 3: the queue's check tokenizes its data (the one tokenization of the change:
    its lengths, its placement check and its slot all use it), the two replicas serve it, so the fleet keeps them
    and the re-plan runs beside the steps, due at step 4 (``--replan-after 1``). The change is a transaction
    (``train.inflight``): recorded in ``.apply.json`` with the fleet before and after it, applied, a checkpoint of
    the new task set started (not waited for); at the next boundary, that checkpoint committed, it settles: the
    ledger, the plan and a ``changes.jsonl`` row say so and ``.apply.json`` is gone."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    with counting() as work:
        assert not changes.due(2, running)
        assert changes.next_boundary() == 3
        assert due_when_ready(changes, 3, running)
        after = changes.at_boundary(3, running)
        changes.replan.running.answer()  # the thread's work done before the scope closes
    assert work["tokenizations"] == 1
    assert isinstance(after, Running) and after.names == ["docsum", "chat", "codegen"]
    assert after.plan.describe() == running.plan.describe() and after.cost_model is not running.cost_model
    assert fake.applied == [(3, ("docsum", "chat", "codegen"), "<1,1> x 2", ("codegen",))]
    assert fake.checkpoints == [(3, False)]
    assert changes.replan.at == 4 and changes.next_boundary() == 4
    assert json.loads((options.queue_dir / ".replan.json").read_text()) == {"step": 3, "at": 4}
    pending = load_pending(options.queue_dir)
    assert pending.before.plan.tasks == ("docsum", "chat") and pending.after.plan.tasks == ("docsum", "chat", "codegen")
    assert pending.replan_at == 4 and not pending.for_launcher and _rows(options) == []
    assert (options.queue_dir / "accepted" / "add-codegen.yaml").is_file()
    assert changes.due(4, after)  # its re-plan's answer is due; the change settles first
    assert not (options.queue_dir / ".apply.json").exists()
    assert DeploymentPlan.load(options.run_dir.plan).tasks == ("docsum", "chat", "codegen")
    assert [e["spec"]["name"] for e in json.loads(options.run_dir.ledger.read_text())["tasks"]][-1] == "codegen"
    (row,) = _rows(options)
    assert (row.step, row.kind, row.outcome, row.tasks, row.replan_at) == (
        3,
        ChangeKind.CHANGE,
        Outcome.KEPT_REPLANNING,
        ("docsum", "chat", "codegen"),
        4,
    )
    assert [(r.action.value, r.name, r.file) for r in row.requests] == [("add", "codegen", "add-codegen.yaml")]
    assert row.seconds == 0.25 and row.rebuilt == ()
    schema = SCHEMAS["changes"]()  # ``lorafleet schema changes``
    for line in options.run_dir.changes.read_text().splitlines():
        jsonschema.Draft202012Validator(schema).validate(json.loads(line))


def test_the_replan_answer_is_applied_at_its_step_and_a_new_change_supersedes_it(fleet):
    """The re-plan of the add at step 3 answers at step 4 (kept or moved, a ``replan`` row either way); a second
    add at step 5 is decided from the running deployment, and a change at the step its own re-plan is due
    supersedes that re-plan (never applied, ``.replan.json`` removed)."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    due_when_ready(changes, 3, running)
    running = changes.at_boundary(3, running)
    assert not changes.due(4, running) or changes.replan.running is not None
    answered = changes.at_boundary(4, running)
    assert isinstance(answered, Running) and changes.replan.running is None
    assert [r.kind for r in _rows(options)] == [ChangeKind.CHANGE, ChangeKind.REPLAN]
    assert _rows(options)[1].replanned_for == 3 and _rows(options)[1].outcome in (Outcome.KEPT, Outcome.MOVED)
    add_request(options.queue_dir, "chat2", batch=2, context=128, at_step=5, data="chat")
    due_when_ready(changes, 5, answered)
    later = changes.at_boundary(5, answered)
    assert changes.replan.running is not None and changes.replan.at == 6
    add_request(options.queue_dir, "chat3", batch=2, context=128, at_step=6, data="chat")
    assert due_when_ready(changes, 6, later)
    changes.at_boundary(6, later)
    assert (
        changes.replan.running is not None and changes.replan.running.step == 6
    )  # 5's re-plan superseded, 6's started
    changes.finish()  # the run ends: the change of step 6 settles on its committed checkpoint
    assert [r.step for r in _rows(options)] == [3, 4, 5, 6] and not (options.queue_dir / ".apply.json").exists()


def test_a_request_that_arrives_while_a_boundary_applies_its_change_waits_for_the_next_boundary(fleet):
    """#43: a boundary reads the queue once, when the loop reaches it. A request that arrives while its change is
    applied (here written after ``at_boundary``, as during a rebuild) is no second change at that step (two would share
    a checkpoint's ``fleet_changed_at``, which tells a restart which side of a change it is on): the loop runs the step
    on the changed fleet, and the next boundary takes it, superseding the re-plan due there. A start at a boundary
    that has a change record (a restart from the join's checkpoint, or the launcher's relaunch) reads it no more either.
    ``simulate --arrivals`` replays the same rule (``tests/arrivals``)."""
    from tests.helpers.fake_fleet import restarted

    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    due_when_ready(changes, 3, running)
    after = changes.at_boundary(3, running)
    (options.queue_dir / "share.yaml").write_text("action: update\nname: docsum\nshare: 0.5\n")
    assert not changes.due(3, after)  # step 3 runs on the changed fleet
    assert changes.due(4, after) and changes.replan.at == 4
    later = changes.at_boundary(4, after)
    assert later.workload.tasks[0].spec.share == 0.5 and changes.replan.running.step == 4  # 3's re-plan superseded
    changes.replan.running.answer()
    fake.checkpoint(5)  # the run's last, taken after the change of step 4
    changes.finish()
    rows = [(r.step, r.kind, tuple(q.name for q in r.requests)) for r in _rows(options)]
    assert rows == [(3, ChangeKind.CHANGE, ("codegen",)), (4, ChangeKind.CHANGE, ("docsum",))]
    again = restarted(options, later, fake)
    again.resume(4, later)  # from a checkpoint of step 4, its change recorded
    (options.queue_dir / "share.yaml").write_text("action: update\nname: docsum\nshare: 0.25\n")
    assert not again.due(4, later) and again.due(5, later)


def test_an_update_alone_keeps_the_deployment_without_a_replan(fleet):
    options, running, changes, fake = fleet
    (options.queue_dir / "share.yaml").write_text("action: update\nname: docsum\nshare: 0.5\nat_step: 2\n")
    assert changes.due(2, running)
    after = changes.at_boundary(2, running)
    assert changes.replan.running is None and fake.checkpoints == []
    assert after.workload.tasks[0].spec.share == 0.5
    (row,) = _rows(options)
    assert row.outcome is Outcome.KEPT and row.replan_at is None


def test_a_task_no_replica_holds_replans_at_the_boundary_and_hands_off_when_it_needs_more_processes(fleet):
    """``moddoc``'s 1,536-token documents fit no ``<1,1>``: the boundary re-plans (no re-plan beside the steps); on
    a fleet of 2 processes the new plan needs more, so the change is handed to the launcher with a checkpoint."""
    options, running, changes, fake = fleet
    fake.world_size = 2
    add_request(options.queue_dir, "moddoc", batch=1, context=1536, at_step=1)
    due_when_ready(changes, 1, running)
    assert changes.at_boundary(1, running) is Stop.HANDED_OFF
    assert fake.applied == [] and fake.checkpoints == [(1, True)]
    (row,) = _rows(options)
    assert row.outcome is Outcome.HANDED_OFF and "re-planned to" in row.note
    assert (options.queue_dir / ".apply.json").exists()  # the launcher applies it


def test_a_task_no_replica_holds_moves_the_fleet_at_its_boundary_on_one_tokenization(fleet):
    """With the processes for it, ``moddoc``'s boundary re-plans and moves the fleet in place: its data tokenized
    once (the check), its lengths for the re-plan read from that, the move recorded with its re-plan's reason."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "moddoc", batch=1, context=1536, at_step=1)
    with counting() as work:
        due_when_ready(changes, 1, running)
        after = changes.at_boundary(1, running)
    assert work["tokenizations"] == 1
    assert isinstance(after, Running) and after.plan.describe() != running.plan.describe()
    assert fake.applied[0][2] == after.plan.describe() and changes.replan.running is None
    assert fake.checkpoints == [(1, False)] and _rows(options) == []  # a move settles on a checkpoint after it
    changes.due(2, after)
    (row,) = _rows(options)
    assert row.outcome is Outcome.MOVED and row.note.startswith("re-planned to ")


def test_departures_are_the_tasks_that_took_their_steps(fleet):
    """Mid-run, a task whose ``steps`` are done is handed to the running fleet like a queued finish (its adapter
    exported, its slot freed, the fleet re-planned for the others)."""
    from lorafleet.runtime.data_stream import DataStreams
    from lorafleet.train.queue import Action
    from tests.helpers.fleet_harness import synthetic_task

    options, running, changes, fake = fleet
    a, b = synthetic_task("a", 30, (20, 40), 0), synthetic_task("b", 30, (20, 40), 1)
    streams = DataStreams([a, b], (2, 3), seed=7, max_batches=(3, None))
    fake.end_steps = lambda horizon: {["a", "b"][t]: end for t, end in streams.end_steps(horizon).items()}
    assert departures_due(fake, 2, STEPS, False) == ([], 3)  # the run ends a window where a is done
    done, later = departures_due(fake, 3, STEPS, False)
    assert [(r.name, r.action) for r in done] == [("a", Action.FINISH)] and later is None
    streams.retire(0, 1)  # stopped for non-finite updates: not finished
    assert departures_due(fake, 5, STEPS, False) == ([], None)


@pytest.mark.parametrize("after", [0, 2])
def test_decide_keeps_the_running_deployment_while_its_replan_runs_beside_the_steps(after):
    """The rule of ``planner.decision``: an update alone keeps the deployment without a re-plan; a join or leave
    keeps it for ``replan_after`` steps when it can serve the new tasks, else re-plans now."""
    running, kept = SimpleNamespace(name="running"), SimpleNamespace(name="kept")
    asked = []

    def keep():
        asked.append(1)
        return kept

    assert decide(5, False, keep, running, after) == Keep(running) and not asked
    decision = decide(5, True, keep, running, after)
    assert decision == (Keep(kept, 5 + after) if after else ReplanNow())
    assert decide(5, True, lambda: None, running, after) == ReplanNow()


def test_settle_moves_keeps_or_hands_off():
    plan = SimpleNamespace(world_size=4)
    assert settle(SimpleNamespace(moved=False, plan=plan), 2) == Keep(plan)
    assert settle(SimpleNamespace(moved=True, plan=plan), 4) == Move(plan)
    assert settle(SimpleNamespace(moved=True, plan=plan), 2) == HandOff(plan)
    assert settle(SimpleNamespace(moved=True, plan=plan)) == Move(plan)


def test_running_after_a_move_keeps_what_the_staying_replicas_measured(fleet):
    _, running, _, _ = fleet
    running.recalibrator.load_state_dict(running.recalibrator.state_dict())
    one = replace(running.plan, replicas=running.plan.replicas[:1])
    after = running.after(running.workload, one, running.cost_model)
    assert after.recalibrator is not running.recalibrator and after.plan is one
    same = running.after(running.workload, running.plan, running.cost_model)
    assert same.recalibrator is running.recalibrator


def test_an_add_is_checked_against_its_data_not_its_declared_lengths(fleet):
    """#38: an add that declared short lengths for long data (``lengths: {values: [100, 120]}`` over 1,536-token
    documents) passed the queue's check, which trusted the declaration; the run stopped at its first step, and
    every resume with it. Its data is what it trains on: the add is rejected in one line, the run goes on."""
    from tests.helpers.repo import DEMO

    options, running, changes, fake = fleet
    (options.queue_dir / "add-moddoc.yaml").write_text(
        f"name: moddoc\ndata: {{path: {DEMO / 'moddoc.jsonl'}}}\nlengths: {{values: [100, 120]}}\nbatch_size: 1\n"
        "context_length: 1536\nat_step: 1\n"
    )
    assert not due_when_ready(changes, 1, running)
    reason = (options.queue_dir / "rejected" / "add-moddoc.yaml.reason").read_text()
    assert "its lengths declare sequences of at most 120 tokens, but its data has one of" in reason


def test_an_adds_data_is_prepared_beside_the_steps_and_the_task_joins_when_it_is_ready(fleet, monkeypatch):
    """#38: a 39 MiB add stalled the whole fleet for 277 s while rank 0 tokenized it at its boundary. A large add's
    data is prepared in a thread from the first reading (``train.joining``): while it is not ready the boundaries go
    on without it (nothing waits), and the task joins at the first boundary after it is, its ``start_step`` that
    step's in the ledger. (A small add's is prepared as its request is read, and it joins at its ``at_step``.)"""
    import threading

    from lorafleet.train import joining

    options, running, changes, fake = fleet
    gate = threading.Event()
    prepare = joining.joining_data

    def slow(task, running, tokenizer):
        gate.wait(timeout=60)
        return prepare(task, running, tokenizer)

    monkeypatch.setattr(joining, "joining_data", slow)
    changes.joining.beside_bytes = 0  # the demo's data is small: every add prepared beside the steps here
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=2)
    assert not changes.due(2, running) and not changes.due(3, running)  # neither boundary waits for the data
    assert (options.queue_dir / "add-codegen.yaml").is_file() and fake.applied == []
    gate.set()
    changes.joining.wait()
    assert changes.due(4, running)
    after = changes.at_boundary(4, running)
    assert after.names == ["docsum", "chat", "codegen"] and [a[0] for a in fake.applied] == [4]
    changes.finish()
    ledger = Ledger.load(options.out)
    assert [(e.spec.name, e.spec.start_step) for e in ledger.entries][-1] == ("codegen", 4)
