"""Arrivals and departures (``lorafleet.arrivals``, ``simulate --arrivals``): the trace format, the replay's
invariants under each strategy, and the command."""

from __future__ import annotations

import re
from dataclasses import fields, replace

import numpy as np
import pytest
import yaml

from lorafleet.arrivals import ArrivalOptions, Strategy, load_trace, replay_trace
from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.planner import PlannerOptions, ReplanObjective, ReplanOptions, plan_deployment
from lorafleet.sampling import task_lengths
from lorafleet.specs.dispatch import DispatchPolicy
from lorafleet.specs.replan import ReplanSettings
from lorafleet.train.options import TrainOptions
from lorafleet.workload import load_workload

# A quick planner: the replay's figures, not the plans' quality, are under test.
FAST = PlannerOptions(robust_samples=0, baselines=False, search_rounds=1, polish_evaluations=0)

WORKLOAD = {
    "model": "llama2-7b",
    "cluster": {"gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4},
    "defaults": {"lora": {"rank": 8, "alpha": 16}},
    "tasks": [
        {
            "name": "chat",
            "lengths": {"mean": 300, "skewness": 3.0, "kurtosis": 15.0},
            "batch_size": 16,
            "context_length": 4096,
            "steps": 12,
        },
        {
            "name": "docs",
            "lengths": {"mean": 2500, "skewness": 1.0, "kurtosis": 1.0},
            "batch_size": 4,
            "context_length": 8192,
            "steps": 6,
        },
    ],
}

CODE = {"lengths": {"mean": 600, "skewness": 2.0, "kurtosis": 8.0}, "batch_size": 8, "context_length": 2048}
EVENTS = [
    {"at": 0.5, "add": {"name": "code", **CODE, "steps": 8}},
    {"at": 1.0, "cancel": "chat"},
    {"at": 1e5, "add": {"name": "late", **CODE, "steps": 3}},  # after everyone has left: the fleet idles
]


def _write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arrivals")
    return _write(tmp / "workload.yaml", WORKLOAD), _write(tmp / "trace.yaml", {"events": EVENTS}), tmp


@pytest.fixture(scope="module")
def setting(files):
    workload_path, trace_path, _ = files
    workload = load_workload(workload_path)
    trace = load_trace(trace_path, workload)
    cluster = workload_cluster(workload)
    return trace, cluster, workload_cost_model(trace.all_tasks(), cluster)


@pytest.fixture(scope="module")
def result(setting):
    trace, cluster, cost_model = setting
    return replay_trace(trace, cluster, cost_model, ArrivalOptions(planner=FAST))


# ------------------------------------------------------------------------------------------- the trace


def test_a_trace_is_read_with_the_workloads_defaults(setting):
    trace, _, _ = setting
    assert trace.names == ("chat", "docs", "code", "late")
    assert [a.at_s for a in trace.arrivals] == [0.0, 0.0, 0.5, 1e5]
    code = trace.arrival("code")
    assert code.task.spec.lora.rank == 8 and code.task.spec.steps == 8  # defaults: apply
    assert code.source == (trace.path, "events[0].add")
    assert [(c.at_s, c.task) for c in trace.cancels] == [(1.0, "chat")]
    assert [t.name for t in trace.subset(["code", "chat"]).tasks] == ["code", "chat"]


def _add(name: str = "x", **extra) -> dict:
    return {"name": name, **CODE, "steps": 4, **extra}


@pytest.mark.parametrize(
    ("events", "field"),
    [
        ([{"at": 0, "add": _add(batch_size=0)}], "events[0].add.batch_size"),
        ([{"at": 0, "add": {k: v for k, v in _add().items() if k != "steps"}}], "events[0].add.steps"),
        ([{"at": 0, "add": _add(share=0.5)}], "events[0].add.share"),
        ([{"at": 0, "add": _add(lengths={"mean": 300})}], "events[0].add.lengths"),
        ([{"at": 0, "add": _add("chat")}], "events[0].add.name"),
        ([{"at": 0, "add": _add()}, {"at": 1, "add": _add()}], "events[1].add.name"),
        ([{"at": 0, "add": _add("bad name")}], "events[0].add.name"),
        ([{"at": 0, "cancel": "nobody"}], "events[0].cancel"),
        ([{"at": 0, "cancel": "x"}, {"at": 1, "add": _add()}], "events[0].cancel"),  # not added yet
        ([{"at": 0, "cancel": "chat"}, {"at": 1, "cancel": "chat"}], "events[1].cancel"),
        ([{"at": 0, "cancel": 3}], "events[0].cancel"),
        ([{"at": 5, "cancel": "chat"}, {"at": 1, "cancel": "docs"}], "events[1].at"),
        ([{"at": -1, "cancel": "chat"}], "events[0].at"),
        ([{"at": "soon", "cancel": "chat"}], "events[0].at"),
        ([{"at": float("inf"), "cancel": "chat"}], "events[0].at"),
        ([{"cancel": "chat"}], "events[0].at"),
        ([{"at": 0}], "events[0]"),
        ([{"at": 0, "cancel": "chat", "add": _add()}], "events[0]"),
        ([{"at": 0, "cancel": "chat", "why": "done"}], "events[0].why"),
        (["chat"], "events[0]"),
        ({"at": 0}, "events"),
    ],
)
def test_a_bad_event_names_its_field(files, setting, events, field):
    _, _, tmp = files
    path = _write(tmp / "bad.yaml", {"events": events})
    with pytest.raises(InputError) as err:
        load_trace(path, setting[0].workload)
    assert (err.value.path, err.value.field) == (path, field), str(err.value)


def test_a_bad_file_and_a_workload_task_without_steps(files, setting, tmp_path):
    _, trace_path, _ = files
    workload = setting[0].workload
    for text, field in (("events: [\n", ""), ("- 1\n", ""), ("events: []\nextra: 1\n", "extra")):
        (tmp_path / "t.yaml").write_text(text)
        with pytest.raises(InputError) as err:
            load_trace(tmp_path / "t.yaml", workload)
        assert err.value.field == field
    with pytest.raises(InputError, match="no such file"):
        load_trace(tmp_path / "absent.yaml", workload)
    stepless = {**WORKLOAD, "tasks": [{k: v for k, v in WORKLOAD["tasks"][0].items() if k != "steps"}]}
    with pytest.raises(InputError) as err:
        load_trace(trace_path, load_workload(_write(tmp_path / "w.yaml", stepless)))
    assert err.value.field == "tasks[0].steps"


def test_the_example_trace_reads():
    from tests.helpers.repo import EXAMPLES

    trace = load_trace(EXAMPLES / "arrivals" / "trace.yaml", load_workload(EXAMPLES / "arrivals" / "workload.yaml"))
    assert trace.names == ("dolly", "chat", "meetingbank", "code")
    assert [c.task for c in trace.cancels] == ["dolly"]


def test_the_replay_is_torch_free():
    import subprocess
    import sys

    code = "import sys, lorafleet.arrivals; print(sorted({'torch', 'triton', 'peft'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_tasks_batches_depend_on_its_name_and_own_step_only(setting):
    trace, _, _ = setting
    code, late = trace.arrival("code").task, trace.arrival("late").task
    a, _, _ = task_lengths(code, 3, seed=0)
    assert np.array_equal(a, task_lengths(code, 3, seed=0)[0]) and a.size == code.batch_size
    assert not np.array_equal(a, task_lengths(code, 4, seed=0)[0])
    assert not np.array_equal(a, task_lengths(late, 3, seed=0)[0])  # same distribution, another name
    assert a.max() <= code.spec.context_length


# ------------------------------------------------------------------------------------------- the replay


def test_every_task_completes_after_it_arrives(result):
    assert [r.strategy for r in result.runs] == list(Strategy)
    for run in result.runs:
        for o in run.tasks.values():
            assert o.completion_s is not None and o.completion_s >= o.arrival_s, (run.strategy, o)
            assert o.start_s is not None and o.arrival_s <= o.start_s <= o.completion_s
            assert o.steps_done == o.steps or o.cancelled
        assert run.finish_s == max(o.completion_s for o in run.tasks.values())
        assert run.steps == len(run.step_s) and all(s > 0 for s in run.step_s)
        # the accounting shares out every step's GPU-seconds; migration is the fleet's
        assert sum(o.gpu_s for o in run.tasks.values()) == pytest.approx(run.step_gpu_s, rel=1e-9)
        assert run.gpu_s == pytest.approx(run.step_gpu_s + run.migration_gpu_s)


def test_a_cancelled_task_departs_at_the_first_window_boundary_after_its_cancel(result):
    for run in result.runs:
        chat = run.tasks["chat"]
        assert chat.cancelled and 0 < chat.steps_done < chat.steps and chat.completion_s >= 1.0
    # static and incremental run <2,1> x 2, no replica pipelined: every step is a window boundary, so chat left at the
    # end of the step in flight at 1.0 s (or at 1.0 s itself, had a step ended there)
    for name in (Strategy.STATIC, Strategy.INCREMENTAL):
        run = result.run(name)
        assert run.tasks["chat"].completion_s < 1.0 + max(run.step_s)
    # scratch moves at 0.91 s onto a plan with a pipelined <1,2> (the pipelined packing prices it better): the cancel
    # lands in its 6.9 s rebuild, so it is read at the end of the new deployment's first window, which docs' departure
    # after its 6 steps ends (``lorafleet train`` reads its queue once a boundary, and at window boundaries only)
    scratch = result.run(Strategy.SCRATCH)
    chat, docs = scratch.tasks["chat"], scratch.tasks["docs"]
    assert _pipelined(scratch.changes[1].plan) and scratch.changes[1].migration_s > 1.0 - scratch.changes[1].at_s
    assert chat.steps_done == docs.steps_done == docs.steps and chat.completion_s == docs.completion_s


def test_on_plans_without_a_pipelined_replica_every_step_is_a_window_boundary(result):
    """Unchanged by #43's windows: an event applies at the end of the step in flight when it comes (code's add at
    0.5 s, chat's cancel at 1.0 s), as ``Change.step``, the first step run after it, says."""
    for name in (Strategy.STATIC, Strategy.INCREMENTAL):
        run = result.run(name)
        ends = np.cumsum(run.step_s)
        assert [int(np.searchsorted(ends, at)) + 1 for at in (0.5, 1.0)] == [1, 2]  # each in step 0, 1: not ended
        if name is Strategy.INCREMENTAL:
            assert not any(_pipelined(c.plan) for c in run.changes)
            assert [c.step for c in run.changes[:3]] == [0, 1, 2]
        assert run.tasks["code"].start_s == pytest.approx(ends[0]) and run.tasks["chat"].steps_done == 2


def test_an_idle_fleet_is_not_charged_and_waits_for_the_next_arrival(result):
    for run in result.runs:
        late = run.tasks["late"]
        rebuilt = run.changes[-1].torn_down if run.changes else 0
        assert late.start_s == pytest.approx(1e5 + (60.0 if rebuilt else 0.0))
        busy = sum(run.step_s)
        assert busy < 1e4 < run.finish_s  # the idle gap is in the clock, not in the steps


def test_static_plans_once_for_every_task_and_never_migrates(result, setting):
    static = result.run(Strategy.STATIC)
    assert static.plans == 1 and static.moves == static.rebuilt == 0 and static.migration_gpu_s == 0
    assert static.changes == () and set(result.static_plan.tasks) == set(setting[0].names)


def test_scratch_plans_at_every_change(result):
    for name in (Strategy.SCRATCH, Strategy.INCREMENTAL):
        run = result.run(name)
        sets = [c.tasks for c in run.changes]
        assert run.plans == len(run.changes) >= 4  # start, code joins, chat cancelled, ..., late arrives
        assert all(a != b for a, b in zip(sets, sets[1:]))
        assert ("late",) == sets[-1]
        assert run.migration_gpu_s == pytest.approx(sum(c.migration_gpu_s for c in run.changes))
    scratch = result.run(Strategy.SCRATCH)
    assert scratch.rebuilt == sum(c.torn_down for c in scratch.changes)


@pytest.fixture(scope="module")
def swap(files):
    """A long-context task alone (on replicas sized for it), then a short one joins and stays on alone:
    once the long one has left, a fresh plan of smaller replicas is faster on fewer GPU-seconds."""
    _, _, tmp = files
    docs = {**WORKLOAD["tasks"][1], "batch_size": 8, "steps": 4}
    chat = {**WORKLOAD["tasks"][0], "batch_size": 96, "context_length": 2048, "steps": 8}
    workload = load_workload(_write(tmp / "swap-w.yaml", {**WORKLOAD, "tasks": [docs]}))
    trace = load_trace(_write(tmp / "swap-t.yaml", {"events": [{"at": 0.1, "add": chat}]}), workload)
    cluster = workload_cluster(workload)
    return trace, cluster, workload_cost_model(trace.all_tasks(), cluster)


def _incremental(setting, migration_s: float, objective: ReplanObjective = ReplanObjective.MAKESPAN):
    trace, cluster, cost_model = setting
    replan = ReplanOptions(ReplanSettings(migration_s=migration_s, objective=objective))
    options = ArrivalOptions(planner=FAST, replan=replan, strategies=(Strategy.INCREMENTAL,))
    return replay_trace(trace, cluster, cost_model, options).run(Strategy.INCREMENTAL)


@pytest.mark.parametrize("which", ["setting", "swap"])
def test_incremental_with_a_huge_migration_never_rebuilds(request, which):
    """The first plan serves every later task set (the longest task is there from the start)."""
    run = _incremental(request.getfixturevalue(which), 1e9)
    assert run.rebuilt == 0 and run.migration_gpu_s == 0
    assert all(c.torn_down == 0 for c in run.changes)


def test_incremental_without_migration_moves_whenever_a_fresh_plan_is_better(swap):
    """Better: faster (the planner's objective) and on fewer GPU-seconds (the move's saving). A fresh plan
    that is cheaper but slower than the running one is not taken: the warm-started planner prefers the
    running deployment by makespan, and its saving is then 0."""
    trace, cluster, cost_model = swap
    run = _incremental(swap, 0.0)
    assert run.migration_gpu_s == 0
    better = 0
    for change in run.changes[1:]:
        fresh = plan_deployment(trace.subset(change.tasks), cluster, cost_model, FAST).plan
        keep_makespan = change.keep_step_gpu_s / run_gpus(run, change)
        if fresh.expected_gpu_seconds < change.keep_step_gpu_s * (
            1 - 1e-6
        ) and fresh.expected_makespan_s < keep_makespan * (1 - FAST.tie_rel):
            better += 1
            assert change.moved and change.step_gpu_s < change.keep_step_gpu_s, change
        assert change.step_gpu_s <= change.keep_step_gpu_s * (1 + 1e-9)  # never worse than keeping
    assert better >= 1  # the scenario has such a change: the short task left alone on the long one's replicas


def test_the_gpu_s_objective_takes_a_plan_cheaper_but_slower_than_the_running_one(swap):
    """The limit of the makespan objective above, lifted by ``gpu-s`` (#28): with the same changes, it ends every
    change on at most the GPU-seconds per step the makespan objective chose, and on fewer at the change where
    the short task is left alone on the long one's replicas (a trimmed deployment: slower, on fewer GPUs)."""
    makespan, gpu_s = _incremental(swap, 0.0), _incremental(swap, 0.0, ReplanObjective.GPU_S)
    assert [c.tasks for c in gpu_s.changes] == [c.tasks for c in makespan.changes]
    cheaper = 0
    for mine, theirs in zip(gpu_s.changes[1:], makespan.changes[1:], strict=True):
        assert mine.step_gpu_s <= theirs.step_gpu_s * (1 + 1e-9), (mine, theirs)
        cheaper += mine.step_gpu_s < theirs.step_gpu_s * (1 - 1e-3)
    assert cheaper >= 1 and gpu_s.step_gpu_s < makespan.step_gpu_s


def test_a_move_the_running_deployment_can_serve_waits_replan_after_steps_on_it(swap):
    """As ``lorafleet train`` runs a change's re-plan beside the steps (#28): a move found for a task set the
    running deployment can serve is made ``replan_after`` steps later, the tasks on that deployment meanwhile
    (the steps dearer: it is the plan the move leaves); a change of the task set by then supersedes the move.
    With ``replan_after=0`` the moves are made at their changes."""
    trace, cluster, cost_model = swap

    def run(after: int):
        replan = ReplanOptions(ReplanSettings(migration_s=0.0, after=after))
        options = ArrivalOptions(planner=FAST, replan=replan, strategies=(Strategy.INCREMENTAL,))
        return replay_trace(trace, cluster, cost_model, options).run(Strategy.INCREMENTAL)

    at_once, one, three, never = run(0), run(1), run(3), run(1000)
    moves = [(c.tasks, c.plan) for c in at_once.changes if c.moved]
    assert len(moves) == 2 and [(c.tasks, c.plan) for c in one.changes if c.moved] == moves
    # Each move's first step runs on the deployment it leaves, dearer; the steps after it are the same.
    changed = [k for k in range(1, at_once.steps) if at_once.step_s[k] != one.step_s[k]]
    assert len(changed) == 2 and all(one.step_s[k] > at_once.step_s[k] for k in changed)
    assert at_once.step_gpu_s < one.step_gpu_s < three.step_gpu_s < never.step_gpu_s
    # Three steps on: docs departs before the first move is made (superseded), the second is made.
    assert [(c.tasks, c.plan) for c in three.changes if c.moved] == moves[1:]
    assert never.moves == 0 and at_once.steps == one.steps == three.steps == never.steps


def run_gpus(run, change) -> int:
    """GPUs of the deployment running before ``change`` (the one kept or left)."""
    k = run.changes.index(change)
    return run.changes[k - 1].gpus


def _long_joins(tmp_path, *later: dict):
    """chat alone, then ``long`` at 0.2 s, longer than any replica of chat's plan holds, then the ``later`` events:
    the incremental replay, a move priced 1e6 s a replica."""
    short = {**WORKLOAD, "tasks": [WORKLOAD["tasks"][0]]}
    long = {"name": "long", **{**CODE, "context_length": 32768}, "lengths": {"values": [32768]}, "steps": 2}
    trace = load_trace(
        _write(tmp_path / "t.yaml", {"events": [{"at": 0.2, "add": long}, *later]}),
        load_workload(_write(tmp_path / "w.yaml", short)),
    )
    cluster = workload_cluster(trace.workload)
    options = ArrivalOptions(
        planner=FAST, replan=ReplanOptions(ReplanSettings(migration_s=1e6)), strategies=(Strategy.INCREMENTAL,)
    )
    return replay_trace(trace, cluster, workload_cost_model(trace.all_tasks(), cluster), options).runs[0]


def test_an_infeasible_deployment_is_left_whatever_the_migration(tmp_path):
    """A task longer than any replica of the running plan holds forces a move, and its migration is paid."""
    run = _long_joins(tmp_path)
    joined = next(c for c in run.changes if "long" in c.tasks)
    assert joined.keep_step_gpu_s == float("inf") and joined.moved and joined.torn_down > 0
    assert joined.migration_gpu_s >= 1e6 and run.migration_gpu_s == pytest.approx(joined.migration_gpu_s)
    assert run.tasks["long"].steps_done == 2
    assert run.tasks["long"].start_s == pytest.approx(joined.at_s + 1e6)  # the clock waited for the rebuild


def test_an_event_during_a_rebuild_onto_a_plan_without_a_pipelined_replica_is_applied_after_its_first_step(tmp_path):
    """#43: chat's cancel lands in the 1e6 s rebuild of the move ``long`` forces. The rebuild belongs to the boundary
    it is made at, so the cancel is applied at the next one, never as a second change at the move's boundary:
    ``lorafleet train`` reads its queue once a boundary, when the loop reaches it (``tests/train/test_changes.py``).
    The new deployment, <4,1>, pipelines no replica, so that is after its first step (a window a step). The
    changes' steps are ``changes.jsonl``'s: the first step run after each."""
    run = _long_joins(tmp_path, {"at": 10.0, "cancel": "chat"})
    start, joined, cancelled = run.changes
    assert (start.step, start.tasks) == (0, ("chat",)) and joined.moved and joined.tasks == ("chat", "long")
    assert not _pipelined(start.plan) and not _pipelined(joined.plan)
    assert cancelled.tasks == ("long",) and not cancelled.moved
    assert cancelled.step == joined.step + 1  # one step on the new deployment first
    chat = run.tasks["chat"]
    assert chat.cancelled and chat.steps_done == joined.step + 1 < chat.steps
    assert chat.completion_s == pytest.approx(joined.at_s + 1e6 + run.step_s[joined.step])


def _pipelined(described: str) -> bool:
    """A plan (``DeploymentPlan.describe``) with a pipelined replica (pp > 1): its loop window is the pipeline's."""
    return any(int(pp) > 1 for pp in re.findall(r"<\d+,(\d+)", described))


PIPELINED = {"model": "llama2-7b", "cluster": {"gpu": "cpu", "nodes": 4, "gpus_per_node": 1}, **{
    k: WORKLOAD[k] for k in ("defaults",)}}  # fmt: skip
"""One GPU a node, so no replica has TP > 1: the chat task's plan pipelines a replica, as does the long task's."""
JOIN_S, CANCEL_S = 0.2, 5e4


def _joins_a_pipelined_plan(tmp_path, checkpoint_every: int = 50):
    """On ``PIPELINED``: chat alone on a plan with a pipelined replica (steps of ~1,000 s on the cpu preset); ``long``
    added at 0.2 s, in chat's first step, needs a move (no running replica holds it) onto a pipelined <1,4>, priced
    1e6 s; chat cancelled at 5e4 s, in that rebuild. The incremental replay."""
    chat = {**WORKLOAD["tasks"][0], "steps": 30}
    long = {"name": "long", **{**CODE, "context_length": 4608}, "lengths": {"values": [4608]}, "steps": 12}
    events = [{"at": JOIN_S, "add": long}, {"at": CANCEL_S, "cancel": "chat"}]
    workload = load_workload(_write(tmp_path / "w.yaml", {**PIPELINED, "tasks": [chat]}))
    trace = load_trace(_write(tmp_path / "t.yaml", {"events": events}), workload)
    cluster = workload_cluster(workload)
    replan = ReplanOptions(ReplanSettings(migration_s=1e6))
    options = ArrivalOptions(
        planner=FAST, replan=replan, strategies=(Strategy.INCREMENTAL,), checkpoint_every=checkpoint_every
    )
    return replay_trace(trace, cluster, workload_cost_model(trace.all_tasks(), cluster), options).runs[0]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    return _joins_a_pipelined_plan(tmp_path_factory.mktemp("pipelined"))


W = DispatchPolicy().pipeline_window  # 8 steps


def test_an_event_mid_window_on_a_pipelined_plan_applies_at_the_windows_end(pipelined):
    """#43: ``lorafleet train`` reads its queue only at window boundaries (a request it has not seen cannot end a
    window), so the replay applies an event there too: long's add, in step 0 of chat's pipelined plan, at step W,
    the end of its first window (the replay applied it at step 1 before)."""
    start, joined, _ = pipelined.changes
    assert _pipelined(start.plan) and start.tasks == ("chat",) and JOIN_S < pipelined.step_s[0]
    assert joined.step == W and joined.tasks == ("chat", "long") and joined.moved
    assert joined.at_s == pytest.approx(sum(pipelined.step_s[:W]))  # chat trained on alone to the window's end
    assert pipelined.tasks["long"].start_s == pytest.approx(joined.at_s + 1e6)  # after the move's rebuild


def test_an_event_during_a_rebuild_onto_a_pipelined_plan_applies_at_the_end_of_its_first_window(pipelined):
    """#43: chat's cancel lands in the 1e6 s rebuild onto long's pipelined <1,4>. The rebuild belongs to the boundary
    it is made at (one change a boundary), and the next boundary a training run reads its queue at is the end of the
    new deployment's first window: W steps later (one step, before)."""
    _, joined, cancelled = pipelined.changes
    assert _pipelined(joined.plan) and joined.at_s < CANCEL_S < joined.at_s + joined.migration_s
    assert cancelled.tasks == ("long",) and not cancelled.moved
    assert cancelled.step == joined.step + W
    chat = pipelined.tasks["chat"]
    assert chat.cancelled and chat.steps_done == 2 * W
    assert chat.completion_s == pytest.approx(joined.at_s + 1e6 + sum(pipelined.step_s[W : 2 * W]))


def test_a_checkpoint_ends_a_window_as_in_a_training_run(tmp_path):
    """``lorafleet train`` ends a window at every multiple of its ``--checkpoint-every`` too, and reads its queue
    there: every 5 steps here, long joins at step 5 and chat's cancel is read at 10 (the rebuild's first window, from
    5, cut there). The replay's cadence is train's default."""
    start, joined, cancelled = _joins_a_pipelined_plan(tmp_path, checkpoint_every=5).changes
    assert (joined.step, cancelled.step) == (5, 10)
    default = next(f.default for f in fields(TrainOptions) if f.name == "checkpoint_every")
    assert ArrivalOptions().checkpoint_every == default


def test_a_task_no_config_holds_is_named_where_it_was_added(files, setting, tmp_path):
    trace, cluster, cost_model = setting
    huge = {"name": "huge", **{**CODE, "context_length": 1_000_000}, "lengths": {"values": [1_000_000]}, "steps": 2}
    path = _write(tmp_path / "t.yaml", {"events": [{"at": 0, "cancel": "chat"}, {"at": 1, "add": huge}]})
    trace = load_trace(path, trace.workload)
    with pytest.raises(InputError) as err:
        replay_trace(trace, cluster, workload_cost_model(trace.all_tasks(), cluster), ArrivalOptions(planner=FAST))
    assert (err.value.path, err.value.field) == (path, "events[1].add.context_length")


# ------------------------------------------------------------------------------------------- the command


def test_the_command_prints_both_tables(files, capsys):
    _, _, tmp = files
    small = [{"at": 0.2, "add": {"name": "code", **CODE, "steps": 3}}, {"at": 0.3, "cancel": "chat"}]
    trace_path = _write(tmp / "cli.yaml", {"events": small})
    few = {**WORKLOAD, "tasks": [{**WORKLOAD["tasks"][0], "steps": 3}]}
    rc = main(["simulate", _write(tmp / "few.yaml", few), "--arrivals", trace_path, "--migration-s", "30"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "GPU-seconds by strategy" in out and "completion time" in out
    for word in ("incremental", "scratch", "static", "chat", "code", "migration 30 s", "(cut at "):
        assert word in out


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--steps", "3"], "--arrivals"),
        (["--noise", "0.1"], "--arrivals"),
        (["--buckets", "4"], "--arrivals"),
        (["--migration-s", "-1"], "--migration-s"),
        (["--replan-horizon", "0"], "--replan-horizon"),
    ],
)
def test_the_command_refuses_flags_without_meaning_here(files, capsys, argv, field):
    workload_path, trace_path, _ = files
    assert main(["simulate", workload_path, "--arrivals", trace_path, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"<args>: {field}:" in err


def test_a_bad_trace_exits_2_with_one_line(files, capsys):
    workload_path, _, tmp = files
    path = _write(tmp / "bad-cli.yaml", {"events": [{"at": 0, "add": _add(batch_size=-3)}]})
    assert main(["simulate", workload_path, "--arrivals", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}: events[0].add.batch_size:" in err


def test_arrivals_options_defaults():
    options = ArrivalOptions()
    assert options.planner.robust_samples == 0 and not options.planner.baselines
    # A move is priced by the in-process rebuild's measured model unless --migration-s says a flat price (#28).
    assert options.replan.settings.migration_s is None and options.replan.pricing == options.replan.migration
    assert options.replan.settings.horizon == 200 and options.replan.settings.objective is ReplanObjective.MAKESPAN
    assert options.replan.settings.after == 1  # as lorafleet train --replan-after
    assert replace(options, seed=3).seed == 3
