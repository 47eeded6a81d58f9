"""Streamed pipeline windows in a heterogeneous fleet of five ranks: PP4 beside TP1, PP2 beside TP2.

``test_joint_training`` holds the four-rank windows (PP2 and PP4 alone or beside TP1 replicas);
here a PP4 replica streams beside a replica that does not pipeline at all, with micro-batches
that mix tasks (three sequences each, cut across task boundaries), windows of three steps and of
four that end at a checkpoint: every task's adapter must still equal the task trained alone (PEFT,
``train_alone``), to 1e-5 in fp32 and 1e-9 in fp64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file

from lorafleet.executor.torch.checkpoint import latest_step_dir
from tests.helpers import fleet_harness as h
from tests.helpers.trained_alone import ATOL, STEPS, _max_diff, train_alone

RUNS = {
    "pp4+tp1 w3": dict(plan=h.plan_of((1, 4), (1, 1)), window=3),
    "tp2+pp2+tp1 w4, checkpoint at 2": dict(plan=h.plan_of((2, 1), (1, 2), (1, 1)), window=4, save_at=(2,)),
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    runs = {
        f"{name} {str(dtype)[6:]}": h.Run(steps=STEPS, out=str(root / f"{i}-{dtype}"), dtype=dtype, **spec)
        for i, (name, spec) in enumerate(RUNS.items())
        for dtype in ATOL
    }
    reports = h.run_world(5, list(runs.values()), root)
    out = {}
    for (name, run), rep in zip(runs.items(), reports, strict=True):
        final = latest_step_dir(Path(run.out) / "final")
        out[name] = (rep, {t.name: load_file(final / t.name / SAFETENSORS_WEIGHTS_NAME) for t in h.TASKS})
    return out


@pytest.fixture(scope="module")
def references():
    return {dtype: {t.name: train_alone(i, dtype) for i, t in enumerate(h.TASKS)} for dtype in ATOL}


@pytest.mark.parametrize("dtype", list(ATOL))
@pytest.mark.parametrize("name", list(RUNS))
def test_streamed_windows_equal_each_task_alone(fleet, references, name, dtype):
    reports, adapters = fleet[f"{name} {str(dtype)[6:]}"]
    assert [r.step for r in reports] == list(range(STEPS))
    for task in h.TASKS:
        assert _max_diff(adapters[task.name], references[dtype][task.name]) <= ATOL[dtype], task.name


def test_mixed_task_microbatches_are_exercised():
    """The case the schedule's dependency rule exists for: micro-batches holding several tasks."""
    streams = h.synthetic_streams()
    plan = h.make_step_plan(streams.global_batch(0), 2)
    assert any(len(set(mb.task_ids)) > 1 for w in plan.work for mb in w.microbatches)
