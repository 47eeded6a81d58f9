"""When a task is evaluated (``lorafleet.eval_schedule``): a multiple of ``every_steps``, or a rung boundary of its
sweep whatever ``every_steps`` is, for the rungs the sweep can decide; one pure function of the spec and the own
step, which training (``train.evaluation``) and the what-ifs (``eval_replay``) read alike."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from lorafleet.eval_schedule import EvalSchedule
from lorafleet.specs.sweep import sweep_members
from lorafleet.specs.workload import TaskSpec
from lorafleet.sweeps import rung_count
from lorafleet.train.evaluation import Evaluations

GRID = {"optimizer.lr": [1e-4, 3e-4, 1e-3], "lora.rank": [4, 8, 16]}


def members(every: int, rung_steps: int, steps: int | None = 12, grid: dict | None = None) -> list[TaskSpec]:
    sweep = {"grid": grid or GRID, "halving": {"eta": 3, "rung_steps": rung_steps}}
    raw = {"name": "s", "lengths": {"values": [8]}, "batch_size": 2, "context_length": 16, "steps": steps,
           "eval": {"every_steps": every}, "sweep": sweep}  # fmt: skip
    return [TaskSpec.model_validate(m) for m in sweep_members(raw)]


def steps_of(schedule: EvalSchedule, upto: int) -> list[int]:
    return [n for n in range(upto + 1) if schedule.evaluates(n)]


@pytest.mark.parametrize(("n", "eta", "rungs"), [(1, 3, 0), (2, 3, 1), (3, 3, 1), (9, 3, 2), (8, 3, 2), (16, 4, 2),
                                                 (27, 3, 3), (6, 2, 2), (256, 2, 8)])  # fmt: skip
def test_a_sweep_decides_at_most_the_halvings_that_take_it_to_one(n, eta, rungs):
    assert rung_count(n, eta) == rungs


def test_rung_boundaries_evaluate_off_the_every_steps_grid_and_none_after_the_last_rung():
    schedule = EvalSchedule.of(members(every=5, rung_steps=2)[0])
    assert schedule == EvalSchedule(every_steps=5, rung_steps=2, rungs=2)  # 9 -> 3 -> 1
    assert steps_of(schedule, 20) == [2, 4, 5, 10, 15, 20]  # not 6, 8, ...: the sweep is decided at 4
    assert [schedule.rung(n) for n in (2, 4, 6, 5)] == [1, 2, None, None]
    # the bench's users' setting: rungs every 2 steps, evaluated otherwise only at the end
    assert steps_of(EvalSchedule.of(members(every=12, rung_steps=2)[4]), 12) == [2, 4, 12]


PLAIN = TaskSpec(name="t", lengths={"values": [8]}, batch_size=2, context_length=16, eval={"every_steps": 2})


@pytest.mark.parametrize("spec", [members(every=2, rung_steps=4)[0], members(every=3, rung_steps=6)[0], PLAIN],
                         ids=["aligned", "aligned-3", "no-sweep"])  # fmt: skip
def test_where_rungs_fall_on_the_grid_the_schedule_is_every_steps_alone(spec):
    every = spec.eval.every_steps
    assert steps_of(EvalSchedule.of(spec), 60) == list(range(every, 61, every))


@pytest.mark.parametrize(("every", "rung_steps", "rungs"), [(5, 2, 2), (7, 3, None), (4, 6, 3), (1, 1, 2), (12, 5, 1)])
def test_next_agrees_with_a_scan(every, rung_steps, rungs):
    schedule = EvalSchedule(every, rung_steps, rungs)
    due = steps_of(schedule, 200)
    for own in range(150):
        assert schedule.next_after(own) == min(n for n in due if n > own), own


def test_the_schedule_is_the_specs_own_a_resume_reads_it_the_same():
    """A resumed run's tasks are read back from its files (``model_dump`` as JSON): the same schedule, no state."""
    for spec in members(every=5, rung_steps=2):
        again = TaskSpec.model_validate(json.loads(json.dumps(spec.model_dump(mode="json"))))
        assert again.member_of.members == 9 and EvalSchedule.of(again) == EvalSchedule.of(spec)
    old = members(every=5, rung_steps=2)[0]
    old = old.model_copy(update={"member_of": old.member_of.model_copy(update={"members": None})})
    assert steps_of(EvalSchedule.of(old), 10) == [2, 4, 5, 6, 8, 10]  # recorded before its size: every rung boundary


@dataclass
class EveryStep:
    """A fleet where every task takes a batch at every step, to its ``steps``."""

    specs: dict[str, TaskSpec]

    def batches_taken(self, name, step):
        last = self.specs[name].steps
        return step if last is None else min(step, last)

    def max_batches(self, name):
        return self.specs[name].steps


def test_training_evaluates_at_the_schedules_steps_and_the_last_and_names_them_ahead():
    specs = [
        members(every=5, rung_steps=2)[0],
        PLAIN.model_copy(update={"name": "plain", "eval": PLAIN.eval.model_copy(update={"every_steps": 5})}),
    ]
    end = 20
    evaluations = Evaluations(EveryStep({s.name: s for s in specs}), end)
    due = {b: evaluations.due(b, specs) for b in range(1, end + 1)}
    assert [b for b, d in due.items() if specs[0].name in d] == [2, 4, 5, 10, 12]  # 12: its last
    assert [b for b, d in due.items() if "plain" in d] == [5, 10, 15, 20]
    for step in range(end):
        assert evaluations.next_boundary(step, specs) == min(
            (b for b, d in due.items() if b > step and d), default=None
        )


def test_an_update_of_a_members_every_steps_moves_its_other_evaluations_not_its_rungs():
    """The queue's and HTTP's update (``requests.updated_task``) may set a member's ``every_steps`` to any value
    (before, one off the rungs' grid could leave a rung undecided: not every member was due there)."""
    from lorafleet.train.queue.requests import updated_task

    updated = updated_task(members(every=4, rung_steps=2)[0], {"eval": {"every_steps": 7}})
    assert updated.member_of.members == 9 and steps_of(EvalSchedule.of(updated), 14) == [2, 4, 7, 14]
