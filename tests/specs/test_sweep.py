"""A task's sweep (``specs.sweep``): its members (names, values, order), the keys it may set, and every bad sweep as
one line naming the field, with exit 2."""

from __future__ import annotations

import pytest
import yaml

from lorafleet.cli import main
from lorafleet.specs.sweep import MAX_MEMBERS, value_label
from lorafleet.workload import load_workload

GRID = {"optimizer.lr": [1.0e-4, 3.0e-4, 1.0e-3], "lora.rank": [8, 16, 32]}


def write(tmp_path, *tasks, **top):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"model": "llama2-7b", **top, "tasks": list(tasks)}, sort_keys=False))
    return path


def swept(sweep, **task):
    return {"name": "bot", "preset": "dolly", "eval": {"split": 0.05, "every_steps": 20}, **task, "sweep": sweep}


def test_a_grid_expands_into_members_named_by_their_values_in_order(tmp_path):
    path = write(tmp_path, {"name": "other", "preset": "dolly"}, swept({"grid": GRID}, lora={"alpha": 32}),
                 defaults={"optimizer": {"weight_decay": 0.01}})  # fmt: skip
    tasks = load_workload(path).spec.tasks
    assert [t.name for t in tasks[:4]] == ["other", "bot.lr=1e-4.rank=8", "bot.lr=1e-4.rank=16", "bot.lr=1e-4.rank=32"]
    members = tasks[1:]
    assert len(members) == 9 and [m.member_of.index for m in members] == list(range(9))
    assert [(m.optimizer.lr, m.lora.rank) for m in members[3:6]] == [(3e-4, 8), (3e-4, 16), (3e-4, 32)]
    # the task's own keys and the defaults stay under the swept ones; the data and its order are the sweep's
    assert all(m.lora.alpha == 32 and m.optimizer.weight_decay == 0.01 for m in members)
    assert {m.seed_name for m in members} == {"bot"} and tasks[0].seed_name == "other"
    assert members[4].member_of.values == (("optimizer.lr", 3e-4), ("lora.rank", 16))
    assert members[4].export_dir == "bot/members/bot.lr=3e-4.rank=16"


def test_a_random_sweep_is_drawn_the_same_every_time_within_its_ranges(tmp_path):
    sweep = {"random": {"n": 12, "seed": 7, "space": {"optimizer.lr": {"low": 1e-5, "high": 1e-3, "log": True},
                                                       "lora.rank": {"low": 4, "high": 64},
                                                       "lora.dropout": [0.0, 0.1]}}}  # fmt: skip
    first = load_workload(write(tmp_path, swept(sweep))).spec.tasks
    again = load_workload(write(tmp_path, swept(sweep))).spec.tasks
    assert [t.name for t in first] == [t.name for t in again] and len(first) == 12
    assert all(
        1e-5 <= t.optimizer.lr <= 1e-3 and 4 <= t.lora.rank <= 64 and t.lora.dropout in (0.0, 0.1) for t in first
    )
    assert all(isinstance(t.lora.rank, int) for t in first)
    assert len({t.optimizer.lr for t in first}) > 6  # drawn, not one value


def test_value_labels():
    assert [value_label(v) for v in (3e-4, 1e-3, 0.05, 16, True, 2.0, ["q_proj", "v_proj"], 1.5e5)] == [
        "3e-4", "1e-3", "0.05", "16", "true", "2", "q_proj-v_proj", "1.5e5"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("sweep", "task", "where", "message"),
    [
        ({"grid": {}}, {}, "S.grid", "is empty"),
        ({"grid": {"optimizer.lr": []}}, {}, "S.grid.optimizer.lr", "has no value"),
        ({"grid": {"lora.rnak": [8]}}, {}, "S.grid.lora.rnak", "'lora.rnak' cannot be swept: no such key"),
        ({"grid": {"batch_size": [8, 16]}}, {}, "S.grid.batch_size", "changes the task's data or its run"),
        ({"grid": {"lora.rank": [8, 0]}}, {}, "S.grid.lora.rank", "value 0: Input should be greater than 0"),
        ({"grid": {"optimizer.lr": [-1.0]}}, {}, "S.grid.optimizer.lr", "-1.0: Input should be greater than 0"),
        ({"grid": GRID, "halving": {"eta": 1, "rung_steps": 20}}, {}, "S.halving.eta", "equal to 2"),
        ({"grid": GRID, "halving": {"rung_steps": 20}}, {"eval": None}, "S.halving", "halving needs an eval"),
        ({"grid": GRID, "halving": {"rung_steps": 0}}, {}, "S.halving.rung_steps", "greater than or equal to 1"),
        ({"grid": {"lora.rank": list(range(1, 18)), "lora.alpha": list(range(1, 17))}}, {}, "S",
         f"expands into 272 members; at most {MAX_MEMBERS}"),
        ({"grid": {"optimizer.lr": [1e-4, 0.0001]}}, {}, "S", "members 1 and 2 are both named 'bot.lr=1e-4'"),
        ({"grid": GRID, "random": {"n": 2, "space": {"lora.rank": [8]}}}, {}, "S", "exactly one of grid and random"),
        ({"grid": {"lora.rank": [8]}}, {"batch_size": 0}, "tasks[0].batch_size", "greater than 0"),
        ({"grid": {"lora.rank": [8]}}, {"name": "b" * 60}, "S", "is not a valid task name"),
    ],
    ids=["empty", "no-value", "unknown-key", "data-key", "rank-0", "lr-negative", "eta-1", "no-eval", "rung-steps",
         "too-many", "collision", "both-kinds", "bad-task", "long-name"],
)  # fmt: skip
def test_a_bad_sweep_is_one_line_exit_2(tmp_path, capsys, sweep, task, where, message):
    raw = {k: v for k, v in swept(sweep, **task).items() if v is not None}
    path = write(tmp_path, raw)
    assert main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    where = where.replace("S", "tasks[0].sweep", 1) if where.startswith("S") else where
    assert f"{path}: {where}: " in err and message in err, err


def test_a_sweeps_name_is_no_other_tasks(tmp_path, capsys):
    path = write(tmp_path, swept({"grid": {"lora.rank": [8, 16]}}), {"name": "bot", "preset": "dolly"})
    assert main(["validate", str(path)]) == 2
    assert "task name 'bot' is also a sweep's name" in capsys.readouterr().err


def test_targets_and_rslora_may_be_swept(tmp_path):
    grid = {"lora.target_modules": [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]],
            "lora.use_rslora": [False, True]}  # fmt: skip
    tasks = load_workload(write(tmp_path, swept({"grid": grid}))).spec.tasks
    assert [t.name for t in tasks] == [
        "bot.target_modules=q_proj-v_proj.use_rslora=false", "bot.target_modules=q_proj-v_proj.use_rslora=true",
        "bot.target_modules=q_proj-k_proj-v_proj-o_proj.use_rslora=false",
        "bot.target_modules=q_proj-k_proj-v_proj-o_proj.use_rslora=true",
    ]  # fmt: skip
    assert tasks[3].lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj") and tasks[3].lora.use_rslora


def test_rungs_need_not_fall_on_the_every_steps_grid(tmp_path):
    """Each rung boundary is evaluated whatever ``eval.every_steps`` is (``eval_schedule``): rungs every 30 steps
    with evaluations every 20 is a sweep, and each member knows the sweep's size (the rungs it can decide)."""
    path = write(tmp_path, swept({"grid": GRID, "halving": {"rung_steps": 30}}))
    assert main(["validate", str(path)]) == 0
    members = load_workload(path).spec.tasks
    assert {(m.member_of.halving.rung_steps, m.member_of.members, m.eval.every_steps) for m in members} == {(30, 9, 20)}
