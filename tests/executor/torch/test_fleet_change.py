"""A running fleet changed in its own processes (``executor/torch/change.py``): tasks leave and join at a
step boundary with the deployment kept, then the deployment moves, and every task still trains exactly as
it would alone (1e-5 in fp32 against PEFT per task, ``tests/helpers/trained_alone.py``).

One forked world of 4 gloo processes (no process restarts between the changes):

    steps 0-1   summary, code, chat         on tp1 + tp2              (ranks 0 | 1-2, rank 3 idle)
    step 2      chat finishes, summary-b joins; the deployment is kept: every stage kept, its slots changed
    steps 2-3   summary, code, summary-b
    step 4      the deployment moves from 2 replicas to 3, tp1 + tp1 + pp2 (ranks 0 | 1 | 2-3): rank 0 keeps
                its stage, 1 and 2 build theirs, the idle rank 3 its first; they take the adapters and optimizer
                states; a checkpoint is taken right after
    steps 4-5   on the new deployment

then a fresh executor (a second run in the same world) resumes from the checkpoint taken right after the
move and runs steps 4-5: bitwise the same adapters as the fleet that changed in place.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file

from lorafleet.executor.torch.change import FleetChange
from lorafleet.executor.torch.checkpoint import latest_step_dir
from lorafleet.executor.torch.worker import ExecutorConfig, TorchExecutor
from lorafleet.plans import PlanPool
from lorafleet.runtime.data_stream import DataStreams, task_streams
from lorafleet.specs.workload import TaskSpec
from tests.helpers import fleet_harness as h
from tests.helpers.trained_alone import ATOL, _max_diff, train_alone

STEPS = 6
SUMMARY, CODE, CHAT, SUMMARY_B = range(4)
LENGTHS = [(4, 12), (10, 24), (6, 16), (4, 12)]
KEPT = replace(h.plan_of((1, 1), (2, 1)), pools=(PlanPool("", "cpu", 4, 4),))
MOVED = h.plan_of((1, 1), (1, 1), (1, 2))
JOINS = 2
"""summary-b joins (and chat leaves) at this step; the deployment moves at ``MOVE``."""
MOVE = 4
TOTAL = {SUMMARY: STEPS, CODE: STEPS, CHAT: STEPS, SUMMARY_B: STEPS - JOINS}
"""Each task's schedule length (what the launcher gives a task: the run's steps from its start)."""


def _training(tasks: list[int], plan):
    return [replace(h.TASKS[t], total_steps=TOTAL[t]) for t in tasks], replace(
        plan, tasks=tuple(h.TASKS[t].name for t in tasks)
    )


def _spec(task: int, start: int = 0) -> TaskSpec:
    name = h.TASKS[task].name
    data = {"path": f"/synthetic/{name}"}
    return TaskSpec(name=name, data=data, batch_size=h.BATCH_SIZES[task], context_length=64, start_step=start)


def _data(spec: TaskSpec):
    task = [t.name for t in h.TASKS].index(spec.name)
    return h.synthetic_task(spec.name, 20, LENGTHS[task], 7 + task)


def _streams(specs: list[TaskSpec], departed=()) -> DataStreams:
    return task_streams(specs, [_data(s) for s in specs], 7, departed=departed)


def _executor(tasks: list[int], plan, specs, departed=()) -> TorchExecutor:
    training, plan = _training(tasks, plan)
    config = ExecutorConfig(plan=plan, tasks=tuple(training), seed=0, base_model="tiny-llama")
    return TorchExecutor(
        config,
        h.build_model(),
        _streams(specs, departed),
        torch.device("cpu"),
        base=lambda: (h.build_model(), None),
        task_data=_data,
    )


def _steps(executor: TorchExecutor, steps: range) -> None:
    for step in steps:
        batch = executor.next_global_batch(step)
        executor.run_step(h.make_step_plan(batch, len(executor.config.plan.replicas)))


def _changing(out: Path) -> dict:
    """The fleet of the module doc, changed in place; rank 0 returns what each change reported."""
    executor = _executor([SUMMARY, CODE, CHAT], KEPT, [_spec(SUMMARY), _spec(CODE), _spec(CHAT)])
    if dist.get_rank() != 0:
        executor.serve()
        return {}
    _steps(executor, range(JOINS))
    executor.save_checkpoint(out / "left", JOINS, wait=True)  # chat as it leaves (the trainer's export)
    departed = (replace(executor.streams.turns[CHAT], until=JOINS),)
    specs = (_spec(SUMMARY), _spec(CODE), _spec(SUMMARY_B, JOINS))
    training, plan = _training([SUMMARY, CODE, SUMMARY_B], KEPT)
    kept = executor.change(FleetChange(step=JOINS, tasks=tuple(training), specs=specs, plan=plan, departed=departed))
    _steps(executor, range(JOINS, MOVE))
    _, plan = _training([SUMMARY, CODE, SUMMARY_B], MOVED)
    moved = executor.change(FleetChange(step=MOVE, tasks=tuple(training), specs=specs, plan=plan, departed=departed))
    executor.save_checkpoint(out / "moved", MOVE, wait=True)
    _steps(executor, range(MOVE, STEPS))
    executor.save_checkpoint(out / "final", STEPS, wait=True)
    executor.close()
    return {"kept": kept, "moved": moved, "groups": executor.replica.groups.created}


def _resumed(out: Path) -> dict:
    """A fresh executor on the moved deployment, resumed from the checkpoint taken right after the move."""
    specs = [_spec(SUMMARY), _spec(CODE), _spec(SUMMARY_B, JOINS)]
    departed = (replace(_streams([_spec(CHAT)]).turns[0], until=JOINS),)
    executor = _executor([SUMMARY, CODE, SUMMARY_B], MOVED, specs, departed)
    if dist.get_rank() != 0:
        executor.serve()
        return {}
    state = executor.restore_checkpoint(out / "moved")
    _steps(executor, range(state.step, STEPS))
    executor.save_checkpoint(out / "resumed", STEPS, wait=True)
    executor.close()
    return {}


def _rank_main(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = [_changing(Path(out)), _resumed(Path(out))]
        if rank == 0:
            (Path(out) / "reports.pkl").write_bytes(pickle.dumps(results))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _adapters(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    final = latest_step_dir(directory)
    return {p.name: load_file(p / SAFETENSORS_WEIGHTS_NAME) for p in final.iterdir() if p.is_dir()}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    out = tmp_path_factory.mktemp("change")
    mp.start_processes(_rank_main, args=(4, str(out / "init"), str(out)), nprocs=4, start_method="fork")
    results = pickle.loads((out / "reports.pkl").read_bytes())
    return out, results[0]


def test_every_task_trains_as_alone_across_leaves_joins_and_a_move(fleet):
    out, _ = fleet
    final = _adapters(out / "final")
    assert sorted(final) == ["code", "summary", "summary-b"]
    for task, steps in ((SUMMARY, STEPS), (CODE, STEPS), (SUMMARY_B, STEPS - JOINS)):
        reference = train_alone(task, torch.float32, steps=steps, total_steps=TOTAL[task])
        assert _max_diff(final[h.TASKS[task].name], reference) <= ATOL[torch.float32], h.TASKS[task].name
    left = _adapters(out / "left")["chat"]
    reference = train_alone(CHAT, torch.float32, steps=JOINS, total_steps=TOTAL[CHAT])
    assert _max_diff(left, reference) <= ATOL[torch.float32]


def test_a_resume_from_right_after_a_move_continues_bitwise(fleet):
    out, _ = fleet
    changed, resumed = _adapters(out / "final"), _adapters(out / "resumed")
    assert changed.keys() == resumed.keys()
    for task in changed:
        assert all(torch.equal(changed[task][k], resumed[task][k]) for k in changed[task]), task


def test_a_kept_deployment_keeps_every_stage_and_a_move_rebuilds_only_the_changed_ranks(fleet):
    _, reports = fleet
    kept, moved = reports["kept"], reports["moved"]
    assert kept.rebuilt == () and kept.groups_created == 0 and kept.phases["stage"] == 0.0
    assert moved.rebuilt == (1, 2, 3)  # rank 0 keeps its tp1 replica; 1-2 leave tp2, 3 was idle
    assert moved.phases["stage"] > 0 and moved.phases["state"] > 0
    # One group is new: the holders (0, 1, 3) of layers 2-3 (pp2's second stage); (0, 1, 2), the holders of
    # layers 0-1, is the tp2 replica's set of its replicated factors, and the world group stays.
    assert moved.groups_created == 1
