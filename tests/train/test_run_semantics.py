"""What a run means for its tasks (#42), at component level: a task's learning-rate schedule spans its own steps
whatever the run's ``--steps``."""

from __future__ import annotations

from lorafleet.executor.torch.launch import task_training
from lorafleet.executor.torch.optim import lr_at
from lorafleet.specs.workload import TaskSpec


def _task(**fields) -> TaskSpec:
    return TaskSpec(name="t", data={"path": "/x/t.jsonl"}, batch_size=4, context_length=64, **fields)


def test_a_tasks_schedule_spans_its_own_steps_whatever_the_runs():
    """``epochs: 1`` of 12 batches under ``--steps 5``: the schedule is the 12 steps' (cut at 5, never squeezed into
    them), and a resume told ``--steps 12`` runs the same rates; a task without steps or epochs spans the run's
    steps from its start."""
    task = _task(epochs=1.0)
    short, long = task_training(task, 12, run_steps=5), task_training(task, 12, run_steps=12)
    assert short.total_steps == long.total_steps == 12
    rates = [lr_at(task.optimizer, s, short.total_steps) for s in range(5)]
    assert rates == [lr_at(task.optimizer, s, long.total_steps) for s in range(5)] and rates[-1] > rates[0] / 2
    assert task_training(_task(steps=30), 30, run_steps=10).total_steps == 30
    assert task_training(_task(start_step=3), None, run_steps=10).total_steps == 7
