"""A sweep in a what-if (``simulate``): its members are priced like any tasks, and successive halving drops them at
the same rungs and by the same rule as ``train`` (``lorafleet.sweeps``), by their modelled eval losses: a dropped
member takes no step after its rung, and the halving costs fewer GPU-seconds than the whole grid, which the reference
without stops trains and evaluates as plain tasks (no rung evaluations)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.eval_replay import EvalReplay, with_curves
from lorafleet.planner import plan_deployment
from lorafleet.simulate import simulate_schedule
from lorafleet.specs.loss_curve import LossCurveSpec
from lorafleet.sweeps import may_leave_early
from lorafleet.workload import Workload, load_workload
from tests.helpers.repo import SMALL_WORKLOAD

STEPS = 12


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    raw = dict(SMALL_WORKLOAD)
    chat = {**raw["tasks"][0], "steps": STEPS, "eval": {"every_steps": 2, "max_rows": 32},
            "sweep": {"grid": {"optimizer.lr": [1.0e-4, 3.0e-4, 1.0e-3], "lora.rank": [8, 16]},
                      "halving": {"eta": 3, "rung_steps": 4}}}  # fmt: skip
    path = tmp_path_factory.mktemp("w") / "sweep.yaml"
    path.write_text(yaml.safe_dump({**raw, "tasks": [chat, raw["tasks"][1]]}))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    result = plan_deployment(workload, cluster, workload_cost_model(workload, cluster))
    return workload, result


def curved(workload: Workload, every: int | None = None) -> tuple[Workload, list[str]]:
    """The sweep's members' loss curves: member i's floor is i / 10 lower the later it is in the grid, but the grid's
    3rd member is the best; with their ``eval.every_steps`` set to ``every`` when given."""
    members = [t.name for t in workload.tasks if t.spec.member_of is not None]
    floors = {name: 2.0 - 0.1 * i for i, name in enumerate(members)}
    floors[members[2]] = 1.0
    curves = {n: LossCurveSpec(l_inf=f, a=0.5, alpha=0.5) for n, f in floors.items()}
    workload, _ = with_curves(workload, curves)
    if every is not None:
        tasks = tuple(
            replace(t, spec=t.spec.model_copy(update={"eval": t.spec.eval.model_copy(update={"every_steps": every})}))
            if t.name in members else t
            for t in workload.tasks
        )  # fmt: skip
        spec = workload.spec.model_copy(update={"tasks": tuple(t.spec for t in tasks)})
        workload = replace(workload, spec=spec, tasks=tasks)
    return workload, members


def test_halving_drops_members_by_their_modelled_losses_and_saves_their_steps(planned):
    workload, members = curved(planned[0])
    result = planned[1]
    assert len(members) == 6
    run = simulate_schedule(workload, result.schedule, result.cost_model, STEPS)
    evals = run.evals
    dropped = {n: e.dropped_rung for n, e in evals.items() if e.dropped_rung is not None}
    # rung 1 (step 4): 6 -> 2, the best two floors; rung 2 (step 8): 2 -> 1
    assert {n for n, r in dropped.items() if r == 1} == set(members) - {members[2], members[5]}
    assert dropped.get(members[5]) == 2 and members[2] not in dropped
    assert evals[members[2]].steps == STEPS and evals[members[5]].steps == 8
    assert all(evals[n].steps == 4 for n, r in dropped.items() if r == 1)
    whole = simulate_schedule(workload, result.schedule, result.cost_model, STEPS, stops=False)
    assert all(e.dropped_rung is None and e.steps == STEPS for n, e in whole.evals.items() if n in members)
    swept = lambda r: sum(s for n, s in r.task_gpu_seconds.items() if n in members)  # noqa: E731
    assert swept(run) < 0.6 * swept(whole)  # 36 of the grid's 72 member-steps, on the same plan
    assert run.total_gpu_seconds < whole.total_gpu_seconds


def test_a_rung_off_the_every_steps_grid_is_evaluated_there_and_priced(planned):
    """Rungs every 4 steps, evaluations every 5 (6 members, eta 3: two rungs, at 4 and 8): every member still training
    is evaluated at each rung boundary, a pass like any other (priced, billed), and the same members are dropped;
    after the last rung the survivor is evaluated at 10 and at its last step only."""
    workload, members = curved(planned[0], every=5)
    result = planned[1]
    run = simulate_schedule(workload, result.schedule, result.cost_model, STEPS)
    own = {n: [r.own_step for r in run.evals[n].records] for n in members}
    assert own[members[2]] == [4, 5, 8, 10, 12] and own[members[5]] == [4, 5, 8]
    assert all(own[n] == [4] for n in members if n not in (members[2], members[5]))
    assert [run.evals[n].dropped_rung for n in members] == [1, 1, None, 1, 1, 2]
    assert all(r.seconds > 0 and r.gpu_s > 0 for n in members for r in run.evals[n].records)
    assert all(run.eval_gpu_seconds[n] == pytest.approx(run.evals[n].eval_gpu_s) for n in members)


def test_the_reference_without_stops_evaluates_the_grid_as_plain_tasks(planned):
    """``stops=False`` (what the halving saves against: the grid trained whole) evaluates each member after every
    ``every_steps`` and its last step, as a sweep without halving would, never at a rung boundary: none drops and
    no rung is priced."""
    workload, members = curved(planned[0], every=5)
    result = planned[1]
    whole = simulate_schedule(workload, result.schedule, result.cost_model, STEPS, stops=False)
    assert {n: [r.own_step for r in whole.evals[n].records] for n in members} == dict.fromkeys(members, [5, 10, 12])
    assert all(whole.evals[n].dropped_rung is None and whole.evals[n].steps == STEPS for n in members)
    halved = simulate_schedule(workload, result.schedule, result.cost_model, STEPS)
    assert sum(len(halved.evals[n].records) for n in members) == 6 + 2 + 2 + 1 + 1  # at 4, 5, 8, 10, 12
    assert sum(len(whole.evals[n].records) for n in members) == 6 * 3


def test_every_reference_without_stops_drops_the_halving(planned):
    """The reference is ``EvalReplay``'s (``simulate`` and the arrivals replay both build one): with ``stops=False``
    its members carry no halving, so no replay that uses it evaluates at a rung; a halving sweep is a reason to price
    a reference, as an early stop is."""
    workload = planned[0]
    tasks = {t.name: t for t in workload.tasks}
    members = [n for n, t in tasks.items() if t.spec.member_of is not None]
    assert all(may_leave_early(tasks[n].spec) for n in members)
    reference = EvalReplay(tasks, seed=0, stops=False)
    assert all(reference.tasks[n].spec.member_of.halving is None for n in members)
    assert not any(may_leave_early(reference.tasks[n].spec) for n in members)
    assert EvalReplay(tasks, seed=0).tasks == tasks  # with stops: as given
