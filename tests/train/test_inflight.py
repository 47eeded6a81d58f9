"""A change of the running fleet is a transaction (``train.inflight``): rank 0 dies at each phase of a change, a
new one starts (the ledger, the queue and the pending file as the dead one left them), and the change is applied
exactly once: done again at its step from its record, or only settled when the checkpoint the start resumes from
was taken after it. Without processes (``tests.helpers.fake_fleet``); the end-to-end kills are in
``tests/train/test_task_queue.py``.

The phases a crash can land in, for an add of ``codegen`` at step 3 (joins on the kept deployment) and a finish
of ``chat`` (leaves), the recorded decision, and the record of the checkpoint the restart resumes from:

    accepted     the requests due, not yet recorded: nothing of the change is written (its files stay queued)
    begun        ``.apply.json`` with the fleet before the change
    decided      ... and the fleet after it
    applied      the fleet changed in place; a checkpoint of it started, not committed
    checkpointed a checkpoint after it committed (``fleet_changed_at`` = the change's step), not yet settled
"""

from __future__ import annotations

import json

import pytest

from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan
from lorafleet.runtime.checkpoint_files import FLEET_CHANGED_AT, step_dir_name
from lorafleet.train import changes as changes_module
from lorafleet.train import inflight
from lorafleet.train.change_log import Outcome, read_changes
from lorafleet.train.queue import Ledger, load_pending
from lorafleet.train.resume import in_flight
from lorafleet.train.running import Running
from lorafleet.work import counting
from tests.helpers.fake_fleet import FakeFleet, due_when_ready, fleet_of, restarted
from tests.helpers.queue_fleet import add_request


@pytest.fixture
def fleet(tmp_path, tiny_tokenizer_dir):
    return fleet_of(tmp_path, tiny_tokenizer_dir)


def _checkpoint(options, step: int, changed_at: int | None) -> None:
    """The committed checkpoint of ``step`` as far as a start reads it for a change in flight: its manifest's extra."""
    step_dir = options.run_dir.checkpoints / step_dir_name(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    extra = {FLEET_CHANGED_AT: changed_at} if changed_at is not None else {}
    (step_dir / "manifest.json").write_text(json.dumps({"step": step, "extra": extra}))


def _applied(options) -> list[tuple[int, str, str]]:
    ledger = Ledger.load(options.out)
    return [(a["step"], a["action"].value, a["name"]) for a in ledger.applied] if ledger else []


def test_a_crash_before_the_change_is_recorded_leaves_its_requests_queued(fleet):
    """``accepted``: the watcher found the add due, and rank 0 died before ``.apply.json``: the request file is
    still in the queue, so the restart takes it at its step, once."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    assert due_when_ready(changes, 3, running)  # died here
    assert (options.queue_dir / "add-codegen.yaml").is_file() and load_pending(options.queue_dir) is None
    again = restarted(options, running, FakeFleet())
    again.resume(0, running)
    assert due_when_ready(again, 3, running) and [r.name for r in again.requests] == ["codegen"]


@pytest.mark.parametrize("phase", ["begun", "decided", "applied"])
def test_a_crash_before_the_changes_checkpoint_does_it_again_at_its_step_once(fleet, phase, monkeypatch):
    """``begun``, ``decided``, ``applied``: the restart resumes from a checkpoint before the change (step 0: none
    committed after it), builds the fleet as it was before it (``resume.in_flight``), and rank 0 applies the change
    again at step 3 from its record: the same fleet after it, its decision taken as recorded (never re-planned:
    no deployment is judged), the ledger taking the add once, one row."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    due_when_ready(changes, 3, running)
    if phase == "begun":
        monkeypatch.setattr(inflight, "decided", _die)
    elif phase == "decided":
        monkeypatch.setattr(changes.fleet, "apply", _die)
    with pytest.raises(SystemExit):
        if phase == "applied":
            monkeypatch.setattr(changes.fleet, "checkpoint", _die)
        changes.at_boundary(3, running)
    monkeypatch.undo()
    pending = load_pending(options.queue_dir)
    assert pending.step == 3 and (pending.after is not None) == (phase != "begun")
    assert in_flight(options, 0) == pending.before  # what every rank builds
    assert (options.queue_dir / "accepted" / "add-codegen.yaml").is_file()  # recorded, then accepted
    fresh = FakeFleet()
    again = restarted(options, running, fresh)
    again.resume(0, running)
    assert again.next_boundary() == 3 and not again.due(2, running) and again.due(3, running)
    with counting() as work:
        after = again.at_boundary(3, running)
    assert isinstance(after, Running) and after.names == ["docsum", "chat", "codegen"]
    if phase != "begun":
        assert work["deployments_judged"] == 0  # the recorded decision, not a new one
    assert [a[0] for a in fresh.applied] == [3]
    again.finish()
    assert _applied(options) == [(3, "add", "codegen")] and load_pending(options.queue_dir) is None
    assert [r.step for r in read_changes(options.run_dir.changes)] == [3]
    assert DeploymentPlan.load(options.run_dir.plan).tasks == ("docsum", "chat", "codegen")


def test_a_crash_after_the_changes_checkpoint_only_settles_it(fleet):
    """``checkpointed``: the checkpoint of step 3 was taken after the change, so a start from it builds the fleet
    after the change, and rank 0 only settles it (the ledger, the plan, the row): nothing is applied again."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    due_when_ready(changes, 3, running)
    after = changes.at_boundary(3, running)  # applied, its checkpoint started: died before the next boundary
    _checkpoint(options, 3, changed_at=3)
    pending = load_pending(options.queue_dir)
    assert in_flight(options, 3) == pending.after
    fresh = FakeFleet()
    again = restarted(options, after, fresh)
    again.resume(3, after)
    assert fresh.applied == [] and load_pending(options.queue_dir) is None
    assert _applied(options) == [(3, "add", "codegen")]
    # once: the restarted trainer's ledger came from the fleet it rebuilt (after the change); soak_changes found the
    # run's first added task in it twice, and the next change failing (#38)
    assert [t.name for t in Ledger.load(options.out).active] == ["docsum", "chat", "codegen"]
    assert [(r.step, r.outcome) for r in read_changes(options.run_dir.changes)] == [(3, Outcome.SETTLED)]


def test_a_leaving_tasks_change_is_done_again_from_the_checkpoint_before_it(fleet, monkeypatch):
    """A finish of chat at step 3: its checkpoint of step 3 is taken before the change (``fleet_changed_at`` older);
    a crash after the change was applied restarts from it, with chat in the fleet, and finishes chat at step 3
    again: chat trains no step after 3, its ledger entry says it left at 3, once."""
    options, running, changes, fake = fleet
    exported = []  # the export itself is checkpoint_files' (tests/train/test_adapter_card.py); here, when and what
    monkeypatch.setattr(
        changes_module, "export_leaving", lambda options, step, names, *specs: exported.append((step, names))
    )
    (options.queue_dir / "finish-chat.yaml").write_text("action: finish\nname: chat\nat_step: 3\n")
    changes.due(3, running)
    changes.at_boundary(3, running)
    assert fake.checkpoints[0] == (3, True) and fake.marks[0] is None  # before the change
    _checkpoint(options, 3, changed_at=None)  # the post-change checkpoint never committed
    assert [t["name"] for t in in_flight(options, 3).workload["tasks"]] == ["docsum", "chat"]
    fresh = FakeFleet()
    again = restarted(options, running, fresh)
    again.resume(3, running)
    assert again.due(3, running)
    after = again.at_boundary(3, running)
    assert after.names == ["docsum"] and fresh.applied[0][1] == ("docsum",)
    assert load_pending(options.queue_dir) is not None  # a leave settles on the next checkpoint: the run's last here
    fresh.checkpoint(10, wait=True)
    again.finish()
    assert _applied(options) == [(3, "finish", "chat")] and exported == [(3, ["chat"]), (3, ["chat"])]
    ledger = Ledger.load(options.out)
    assert [(e.spec.name, e.state.value, e.left) for e in ledger.entries] == [
        ("docsum", "active", None),
        ("chat", "finished", 3),
    ]


def test_a_stale_record_is_one_line(fleet):
    """A pending change older than the checkpoint the run resumes from, which was not taken after it (a file left by
    hand, or of another run): one line naming the file, not a traceback in every rank."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    due_when_ready(changes, 3, running)
    changes.at_boundary(3, running)
    _checkpoint(options, 6, changed_at=None)
    with pytest.raises(InputError, match=r"\.apply\.json: step: a change at step 3, but the run resumes from .* 6"):
        in_flight(options, 6)


def test_an_update_alone_settles_at_once(fleet):
    """A share's update carries its step in the turns' history, so a restart from before it replays the steps
    before it as they were: it settles at once, without a checkpoint."""
    options, running, changes, fake = fleet
    (options.queue_dir / "share.yaml").write_text("action: update\nname: docsum\nshare: 0.5\nat_step: 2\n")
    changes.due(2, running)
    changes.at_boundary(2, running)
    assert fake.checkpoints == [] and load_pending(options.queue_dir) is None
    assert _applied(options) == [(2, "update", "docsum")]


def _die(*args, **kwargs):
    raise SystemExit("rank 0 died here")


def test_a_hand_edited_record_naming_an_unknown_task_is_one_line(fleet):
    """#38: a hand-edited ``.apply.json`` (a finish of a task the run never had) was a launcher traceback on every
    ``--resume``. Each request of a change in flight is judged again as the watcher judged it: one line naming
    the file and the request, exit 2."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "codegen", batch=2, context=256, at_step=3)
    due_when_ready(changes, 3, running)
    changes.at_boundary(3, running)
    path = options.queue_dir / ".apply.json"
    raw = json.loads(path.read_text())
    raw["requests"][0].update(action="finish", name="ghost", task=None)
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=r"\.apply\.json: requests\[0\]: no active task 'ghost' in this run"):
        in_flight(options, 0)


def test_a_crash_amid_a_move_restarts_on_the_plan_before_it_and_moves_again_at_its_step(fleet, monkeypatch):
    """#38: a restart during a move before any checkpoint after it replayed the steps before the move on the new plan
    (3.0e-5 off the uninterrupted run, where restarts are promised bitwise under ``--no-recalibrate``). The move
    (``moddoc`` fits no ``<1,1>``: the boundary re-plans to more replicas) settles only on a checkpoint after it;
    a restart before that builds the plan before the move (``resume.in_flight``) and moves at its step again, to
    the plan it recorded, without planning."""
    options, running, changes, fake = fleet
    add_request(options.queue_dir, "moddoc", batch=1, context=1536, at_step=2)
    due_when_ready(changes, 2, running)
    monkeypatch.setattr(changes.fleet, "checkpoint", _die)  # the join's checkpoint: died as it began
    with pytest.raises(SystemExit):
        changes.at_boundary(2, running)
    monkeypatch.undo()
    pending = load_pending(options.queue_dir)
    assert pending.after.plan.describe() != running.plan.describe()  # a move, recorded
    assert in_flight(options, 0).plan.describe() == running.plan.describe()  # the restart runs the old plan
    fresh = FakeFleet()
    again = restarted(options, running, fresh)
    again.resume(0, running)
    with counting() as work:
        assert again.due(2, running)
        after = again.at_boundary(2, running)
    assert work["deployments_judged"] == 0 and after.plan.describe() == pending.after.plan.describe()
    assert [(a[0], a[2]) for a in fresh.applied] == [(2, pending.after.plan.describe())]
