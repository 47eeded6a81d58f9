"""DESIGN's central test: joint training on heterogeneous replicas == each task trained alone.

One world of 4 gloo processes runs every fleet below in turn (forked once: starting a world
costs more than the runs). The reference trains each task alone, in this process, with
PEFT's own LoRA model on the unpadded sequences of that task in the same global batches,
``torch.optim`` and ``clip_grad_norm_``: no code of the executor's step, TP, PP or gradient
sum is shared with it. Following PEFT's mixed-batch test, the references are first shown
to be far apart (so the comparisons cannot pass vacuously).

Two precisions, two tolerances. In fp64 every plan matches to 1e-9: the executor computes
the same function. In fp32 the bound is 1e-5 and the learning rates are LoRA-typical
(1e-4 .. 5e-4), because Adam amplifies rounding: its first update is ``η g / (|g| + ε)``, so
a gradient entry near ``ε = 1e-8`` moves by up to ``η / (4ε)`` per unit of rounding error
(padding, packing and TP change the order of fp32 sums, hence their rounding).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import peft
import pytest
import torch
from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file

from lorafleet.executor.torch.base_model import load_causal_lm
from lorafleet.executor.torch.checkpoint import latest_step_dir
from lorafleet.executor.torch.inject import multi_lora_layers
from lorafleet.executor.torch.peft_export import peft_key
from tests.helpers import fleet_harness as h
from tests.helpers.trained_alone import ATOL, STEPS, _initial_adapters, _max_diff, train_alone

PLANS = {
    "tp1+tp1+tp2": h.plan_of((1, 1), (1, 1), (2, 1)),
    "pp2+tp1+tp1": h.plan_of((1, 2), (1, 1), (1, 1)),
    "tp2pp2-packed": h.plan_of((2, 2)),
    "tp1+pp2, rank 3 idle": h.plan_of((1, 1), (1, 2)),
    "tp2 rc+pp2 rc": h.plan_of((2, 1, True), (1, 2, True)),  # activation recomputation under TP and PP
    "pp4": h.plan_of((1, 4)),
}
#: Runs streamed through pipeline windows (``costmodel.schedule``): a task's next forward waits only
#: for its own update, so steps overlap in the pipeline; the adapters must not change.
WINDOWED = {
    "pp2+tp1+tp1 w4": ("pp2+tp1+tp1", 4),
    "tp2pp2-packed w4": ("tp2pp2-packed", 4),
    "pp4 w4": ("pp4", 4),
    "pp4 w2": ("pp4", 2),
}
#: Qwen2's q/k/v biases are sharded with their column-parallel projections; Mistral's sliding
#: window (8) is shorter than most sequences, across a pipeline boundary.
FAMILY_PLANS = {"qwen2": h.plan_of((2, 1), (1, 1), (1, 1)), "mistral": h.plan_of((1, 2), (2, 1))}


def _runs(root: Path) -> dict[str, h.Run]:
    """fp32 runs by name (with repeats and resumes), then every plan once in fp64 (``<plan> fp64``)."""
    runs = {
        "tp1+tp1+tp2": h.Run(PLANS["tp1+tp1+tp2"], STEPS, out=str(root / "a")),
        "tp1+tp1+tp2 again": h.Run(PLANS["tp1+tp1+tp2"], STEPS, out=str(root / "a2")),
        "pp2+tp1+tp1": h.Run(PLANS["pp2+tp1+tp1"], STEPS, per_microbatch=2, out=str(root / "b"), save_at=(2,)),
        "tp2pp2-packed": h.Run(PLANS["tp2pp2-packed"], STEPS, packed=True, per_microbatch=4, out=str(root / "c")),
        "tp1+pp2, rank 3 idle": h.Run(PLANS["tp1+pp2, rank 3 idle"], STEPS, out=str(root / "d")),
        "tp2 rc+pp2 rc": h.Run(PLANS["tp2 rc+pp2 rc"], STEPS, per_microbatch=2, out=str(root / "e")),
    }
    runs["pp4"] = h.Run(PLANS["pp4"], STEPS, per_microbatch=2, out=str(root / "f"))
    for name, (base, window) in WINDOWED.items():
        runs[name] = replace(runs[base], window=window, save_at=(), out=str(root / name.replace(" ", "-")))
    # Resume the pp2+tp1+tp1 run after 2 steps: on the same plan (bitwise), and on another one.
    runs["pp2+tp1+tp1 resumed"] = h.Run(
        PLANS["pp2+tp1+tp1"], STEPS, per_microbatch=2, out=str(root / "b2"), resume_from=str(root / "b" / "ckpt")
    )
    runs["resumed on tp1+tp1+tp2"] = h.Run(
        PLANS["tp1+tp1+tp2"], STEPS, out=str(root / "b3"), resume_from=str(root / "b" / "ckpt")
    )
    for i, name in enumerate([*PLANS, *WINDOWED]):
        runs[f"{name} fp64"] = replace(runs[name], out=str(root / f"fp64-{i}"), dtype=torch.float64, save_at=())
    for family, plan in FAMILY_PLANS.items():
        runs[f"{family} fp64"] = h.Run(plan, STEPS, out=str(root / family), dtype=torch.float64, family=family)
    return runs


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """name -> (reports, {task: {peft key: tensor}}, final checkpoint directory) of every run."""
    root = tmp_path_factory.mktemp("fleet")
    runs = _runs(root)
    reports = h.run_world(4, list(runs.values()), root)
    out = {}
    for (name, run), rep in zip(runs.items(), reports, strict=True):
        final = latest_step_dir(Path(run.out) / "final")
        out[name] = (rep, {t.name: load_file(final / t.name / SAFETENSORS_WEIGHTS_NAME) for t in h.TASKS}, final)
    return out


@pytest.fixture(scope="module")
def references():
    """(family, dtype) -> task name -> reference adapter."""
    cases = [("llama", dtype) for dtype in ATOL] + [(family, torch.float64) for family in FAMILY_PLANS]
    return {(f, d): {t.name: train_alone(i, d, f) for i, t in enumerate(h.TASKS)} for f, d in cases}


def test_references_are_far_apart(references):
    """Sanity check (PEFT's): training moved every adapter, and two tasks with the same adapter
    spec but other data end far apart, so a mix-up could not pass at either tolerance."""
    initial = _initial_adapters()
    fp32 = references[("llama", torch.float32)]
    for i, task in enumerate(h.TASKS):
        start = {
            peft_key(name, f): getattr(layer, f)[str(i)].detach()
            for name, layer in multi_lora_layers(initial)
            if i in layer.adapters
            for f in ("lora_A", "lora_B")
        }
        assert _max_diff(fp32[task.name], start) > 20 * ATOL[torch.float32]
    assert _max_diff(fp32["summary"], fp32["summary-b"]) > 20 * ATOL[torch.float32]


@pytest.mark.parametrize(
    "run",
    [*PLANS, *WINDOWED, "resumed on tp1+tp1+tp2", *(f"{p} fp64" for p in [*PLANS, *WINDOWED, *FAMILY_PLANS])],
)
def test_joint_equals_each_task_alone(fleet, references, run):
    dtype = torch.float64 if run.endswith("fp64") else torch.float32
    family = run.split()[0] if run.split()[0] in FAMILY_PLANS else "llama"
    _, adapters, _ = fleet[run]
    for task in h.TASKS:
        assert _max_diff(adapters[task.name], references[(family, dtype)][task.name]) <= ATOL[dtype], task.name


def test_losses_are_each_tasks_mean_token_loss(fleet):
    """Reported losses do not depend on the plan (float tolerance) and are plausible CE values."""
    base = [r.losses for r in fleet["tp1+tp1+tp2"][0]]
    for run in ("pp2+tp1+tp1", "tp2pp2-packed", "tp1+pp2, rank 3 idle", "pp4", *WINDOWED):
        for mine, theirs in zip([r.losses for r in fleet[run][0]], base, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[k] - theirs[k]) < 1e-4 for k in mine)
    assert all(6.0 < loss < 7.5 for r in base for loss in r.values())  # ~ln(1024) = 6.93 on a random base


def test_same_seed_gives_bitwise_same_adapters(fleet):
    first, second = fleet["tp1+tp1+tp2"][1], fleet["tp1+tp1+tp2 again"][1]
    for task in h.TASKS:
        assert all(torch.equal(first[task.name][k], second[task.name][k]) for k in first[task.name])


def test_resume_continues_the_exact_run(fleet):
    """4 steps == 2 steps, checkpoint, restore in a fresh executor, 2 steps: bitwise."""
    straight, resumed = fleet["pp2+tp1+tp1"], fleet["pp2+tp1+tp1 resumed"]
    for task in h.TASKS:
        assert all(torch.equal(straight[1][task.name][k], resumed[1][task.name][k]) for k in straight[1][task.name])
    assert [r.step for r in resumed[0]] == [2, 3]
    assert [r.losses for r in resumed[0]] == [r.losses for r in straight[0][2:]]


def test_reports_cover_every_replica_and_token(fleet):
    reports = fleet["tp1+tp1+tp2"][0]
    for report in reports:
        assert len(report.replica_busy_s) == 3 and all(b > 0 for b in report.replica_busy_s)
        assert report.makespan_s >= max(report.replica_busy_s)
        assert set(report.task_tokens) == {t.name for t in h.TASKS}
    idle = fleet["tp1+pp2, rank 3 idle"][0]
    assert all(len(r.replica_busy_s) == 2 for r in idle)


def test_windows_report_every_step(fleet):
    """A window of 4 steps reports each step; their makespans add up to the window's wall time, so
    a streamed step is charged for what it overlapped, not twice."""
    for name in WINDOWED:
        reports = fleet[name][0]
        assert [r.step for r in reports] == list(range(STEPS))
        assert all(
            r.makespan_s > 0 and len(r.replica_busy_s) == len(PLANS[WINDOWED[name][0]].replicas) for r in reports
        )


def test_checkpointed_adapters_load_in_peft(fleet):
    """The final checkpoint of a TP2 x PP2 run holds whole adapters that PeftModel loads as they are."""
    _, adapters, final = fleet["tp2pp2-packed"]
    for task in h.TASKS:
        model = peft.PeftModel.from_pretrained(load_causal_lm(h.TINY), final / task.name)
        loaded = peft.get_peft_model_state_dict(model, save_embedding_layers=False)
        assert loaded.keys() == adapters[task.name].keys()
        assert all(torch.equal(loaded[k], adapters[task.name][k]) for k in loaded)
