"""``lorafleet dispatch``: per-step figures on stdout, assignments in JSON, bad input as one line with exit 2."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lorafleet.cli import main
from lorafleet.presets import LOBRA_7B_PLAN, make_plan
from tests.helpers.planning import LINE_WIDTH, wide_fleet, widest_line

WORKLOAD = """\
model: llama2-7b
cluster: {gpu: A100-40GB, nodes: 2, gpus_per_node: 8}
seed: 3
tasks:
  - {name: chat, lengths: {values: [90, 200, 310, 900, 1500]}, batch_size: 32, context_length: 4096}
  - {name: docs, lengths: {values: [1000, 3000, 9000, 15000]}, batch_size: 8, context_length: 16384}
"""


@pytest.fixture()
def files(tmp_path):
    workload = tmp_path / "workload.yaml"
    workload.write_text(WORKLOAD)
    plan = tmp_path / "plan.json"
    dataclasses.replace(make_plan(LOBRA_7B_PLAN, n_tasks=2), tasks=("chat", "docs"), bucket_boundaries=(16384,)).save(
        plan
    )
    return workload, plan, tmp_path


def test_prints_steps_and_writes_assignments(files, capsys):
    workload, plan, tmp = files
    out = tmp / "dispatch.json"
    assert main(["dispatch", str(workload), "--plan", str(plan), "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for heading in ("solve ms", "makespan s", "padding", "load per replica", "fairness"):
        assert heading in printed
    data = json.loads(out.read_text())
    assert data["kind"] == "lorafleet.DispatchRun" and data["tasks"] == ["chat", "docs"]
    assert [s["step"] for s in data["steps"]] == [0, 1]
    for step in data["steps"]:
        assert len(step["replicas"]) == 8
        rows = [
            (t, n) for r in step["replicas"] for mb in r["microbatches"] for t, n in zip(mb["tasks"], mb["lengths"])
        ]
        assert sorted(t for t, _ in rows) == ["chat"] * 32 + ["docs"] * 8
        for replica in step["replicas"]:
            for mb in replica["microbatches"]:
                assert mb["padded_len"] >= max(mb["lengths"])
                assert [s[0] for s in mb["segments"]] == sorted({*mb["tasks"]}, key=mb["tasks"].index)
        assert step["estimated_makespan_s"] == max(r["estimated_time_s"] for r in step["replicas"])


def test_exact_and_packing(files, capsys):
    workload, plan, _ = files
    argv = [
        "dispatch",
        str(workload),
        "--plan",
        str(plan),
        "--method",
        "exact",
        "--solver",
        "highs",
        "--microbatch",
        "packing",
    ]
    assert main(argv) == 0
    assert "milp:highs:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--steps", "0"], "<args>: --steps: must be >= 1"),
        (["--method", "greedy"], "<args>: --method: 'greedy' is not one of fast, exact, length"),
        (["--time-limit", "0"], "<args>: --time-limit: must be > 0"),
        (["--buckets", "0"], "<args>: --buckets"),
    ],
)
def test_bad_flags_are_one_line_errors(files, capsys, extra, message):
    workload, plan, _ = files
    assert main(["dispatch", str(workload), "--plan", str(plan), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_that_does_not_match_the_workload(files, capsys):
    workload, _, tmp = files
    other = tmp / "other.json"
    make_plan(LOBRA_7B_PLAN, n_tasks=2).save(other)  # task names task0, task1
    assert main(["dispatch", str(workload), "--plan", str(other)]) == 2
    assert "other.json: tasks: the plan is for tasks" in capsys.readouterr().err
    assert main(["dispatch", str(workload), "--plan", str(tmp / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err


def test_sequence_longer_than_every_replica(files, capsys):
    """Found by the plan check, before any batch is drawn."""
    workload, _, tmp = files
    small = tmp / "small.json"
    dataclasses.replace(
        make_plan(LOBRA_7B_PLAN[:2], n_tasks=2), tasks=("chat", "docs"), bucket_boundaries=(16384,)
    ).save(small)
    assert main(["dispatch", str(workload), "--plan", str(small), "--steps", "3"]) == 2
    assert (
        "small.json: replicas: no replica holds task 'docs''s 15000-token sequences (largest max_tokens 4096)"
        in capsys.readouterr().err
    )


def test_a_long_run_shows_progress_and_an_absurd_one_is_refused(files, capsys):
    workload, plan, _ = files
    assert main(["dispatch", str(workload), "--plan", str(plan), "--steps", "50"]) == 0
    err = capsys.readouterr().err
    assert "lorafleet dispatch: 5/50 steps dispatched" in err and "50/50 steps dispatched" in err
    assert main(["dispatch", str(workload), "--plan", str(plan), "--steps", "1000000000"]) == 2
    assert "--steps: must be >= 1 and <= 100,000" in capsys.readouterr().err


def test_hundreds_of_replicas_stay_readable_and_the_json_keeps_every_one(tmp_path, capsys):
    """188 replicas: one row per config (count, GPUs, token share, load min / median / max), the per-step
    load as min / median / max, no column per replica and no line over 160 characters; --json has every
    replica of every step."""
    workload, plan = wide_fleet(tmp_path)
    out = tmp_path / "dispatch.json"
    assert main(["dispatch", str(workload), "--plan", str(plan), "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert widest_line(printed) <= LINE_WIDTH
    rows = [line for line in printed.splitlines() if line.startswith("│ <")]
    assert [row.split("│")[1:3] for row in rows] == [
        [" <1,1>  ", "   144 "],
        [" <2,1>  ", "    40 "],
        [" <8,1>  ", "     4 "],
    ]
    assert "fairness" in printed and "load per replica" in printed
    data = json.loads(out.read_text())
    assert [len(step["replicas"]) for step in data["steps"]] == [188, 188]
    assert all(r["estimated_time_s"] > 0 for step in data["steps"] for r in step["replicas"][:144])
