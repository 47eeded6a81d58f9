"""Who pays what: a step's GPU-seconds shared out among its tasks (``lorafleet.accounting``)."""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.accounting import replica_task_shares, task_gpu_seconds
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.dispatch import solve_step
from lorafleet.executor.simulated import SimulatedExecutor, SimulationOptions
from lorafleet.metrics import sum_task_gpu_seconds
from lorafleet.plans import MicroBatch, ReplicaWork, StepPlan, StepReport
from lorafleet.presets import TP1, TP2, TP2_PP2, TP4, lobra_7b_cost_model, lognormal_batch, make_batch, make_plan

NAMES = ("a", "b", "c", "d")
COST_MODEL = lobra_7b_cost_model()


def _mb(tasks_rows: list[tuple[int, int]], length: int, padded: bool = True) -> MicroBatch:
    """``(task, rows)`` runs of sequences of ``length`` tokens, padded to it or packed."""
    task_ids = tuple(t for t, rows in tasks_rows for _ in range(rows))
    return MicroBatch(
        seq_ids=tuple(range(len(task_ids))),
        task_ids=task_ids,
        lengths=(length,) * len(task_ids),
        padded_len=length if padded else None,
    )


def _step(plan, microbatches_per_replica, step: int = 0) -> StepPlan:
    work = tuple(
        ReplicaWork(
            replica_id=r.replica_id,
            microbatches=tuple(mbs),
            estimated_time_s=COST_MODEL.replica_time(r.config, [mb.shape for mb in mbs]),
        )
        for r, mbs in zip(plan.replicas, microbatches_per_replica, strict=True)
    )
    return StepPlan(step=step, bucket_boundaries=(), work=work, estimated_makespan_s=0.0)


def _report(busy, makespan, step: int = 0) -> StepReport:
    return StepReport(step=step, replica_busy_s=tuple(busy), makespan_s=makespan)


def _random_step(rng: np.random.Generator, plan, n_tasks: int) -> StepPlan:
    """Random micro-batches, many mixing tasks, padded or packed; about one replica in four has none."""
    per_replica = []
    for _ in plan.replicas:
        if rng.uniform() < 0.25:
            per_replica.append([])
            continue
        mbs = []
        for _ in range(rng.integers(1, 6)):
            tasks = rng.choice(n_tasks, size=rng.integers(1, n_tasks + 1), replace=False)
            mbs.append(_mb([(int(t), int(rng.integers(1, 4))) for t in sorted(tasks)], int(rng.integers(16, 1024))))
            if rng.uniform() < 0.5:
                mbs[-1] = MicroBatch(mbs[-1].seq_ids, mbs[-1].task_ids, mbs[-1].lengths, None)
        per_replica.append(mbs)
    return _step(plan, per_replica)


@pytest.mark.parametrize("seed", range(8))
def test_the_shares_add_up_to_the_step_cost_and_none_is_negative(seed):
    rng = np.random.default_rng(seed)
    plan = make_plan(((TP1, 3), (TP2, 2), (TP2_PP2, 1), (TP4, 1)), n_tasks=len(NAMES))  # 1 to 4 GPUs a replica
    step = _random_step(rng, plan, len(NAMES))
    estimates = np.array([w.estimated_time_s for w in step.work])
    busy = estimates * rng.uniform(0.5, 2.0, estimates.size)  # measured: off the estimates, replica by replica
    makespan = float(busy.max() * rng.uniform(1.0, 1.2))  # plus synchronisation
    owed = task_gpu_seconds(step, _report(busy, makespan), plan, COST_MODEL, NAMES)
    assert list(owed) == list(NAMES)
    assert sum(owed.values()) == pytest.approx(makespan * plan.used_gpus, rel=1e-12)
    assert all(v >= 0 for v in owed.values())
    present = {NAMES[t] for w in step.work for mb in w.microbatches for t in mb.task_ids}
    assert all((owed[n] > 0) == (n in present) for n in NAMES)  # absent tasks owe nothing
    shares = replica_task_shares(step, plan, COST_MODEL, len(NAMES))
    with_work = np.array([bool(w.microbatches) for w in step.work])
    assert np.allclose(shares[with_work].sum(axis=1), 1.0) and not shares[~with_work].any()


@pytest.mark.parametrize("seed", range(3))
def test_dispatched_and_simulated_steps_add_up(seed):
    """Real dispatch (mixed-task micro-batches), noise and a straggler; a batch of three sequences
    leaves most of the seven replicas idle."""
    plan = make_plan(((TP1, 4), (TP2, 2), (TP2_PP2, 1)), n_tasks=6)
    options = SimulationOptions(noise_sigma=0.1, slowdown={1: 1.7}, seed=seed)
    batches = (lognormal_batch(seed, scale=0.3, max_len=4096), make_batch([300, 90, 1200], [0, 3, 5], step=seed))
    for batch in batches:
        step = solve_step(batch, plan, COST_MODEL, plan.policy.options).plan
        assert step.step == seed
        report = SimulatedExecutor(plan, COST_MODEL, plan.tasks, options).run_step(step)
        owed = task_gpu_seconds(step, report, plan, COST_MODEL, plan.tasks)
        assert sum(owed.values()) == pytest.approx(report.makespan_s * plan.used_gpus, rel=1e-12)
        assert min(owed.values()) >= 0
        assert {t for t, v in owed.items() if v > 0} == {plan.tasks[t] for t in batch.task_ids}
    assert any(not w.microbatches for w in step.work)  # the three-sequence batch left replicas idle
    first = solve_step(batches[0], plan, COST_MODEL, plan.policy.options).plan
    assert any(len(set(mb.task_ids)) > 1 for w in first.work for mb in w.microbatches)


def test_a_task_on_a_replica_twice_as_slow_pays_more():
    """Two tasks with the same work on two <1,1> replicas: measured 2:1, they pay 2:1 of the step."""
    plan = make_plan(((TP1, 2),), n_tasks=2)
    step = _step(plan, [[_mb([(0, 2)], 512)], [_mb([(1, 2)], 512)]])
    t = step.work[0].estimated_time_s
    even = task_gpu_seconds(step, _report((t, t), t), plan, COST_MODEL, ("slow", "fast"))
    assert even["slow"] == pytest.approx(even["fast"]) == pytest.approx(t)
    owed = task_gpu_seconds(step, _report((2 * t, t), 2 * t), plan, COST_MODEL, ("slow", "fast"))
    cost = 2 * t * 2  # the makespan, both GPUs
    assert owed["slow"] == pytest.approx(cost * 2 / 3) and owed["fast"] == pytest.approx(cost / 3)
    assert owed["slow"] > even["slow"] and owed["fast"] > even["fast"]  # fast also pays for waiting


def test_the_idle_time_is_shared_by_busy_gpu_seconds():
    """Replica 0 (1 GPU) runs a for 1 s, replica 1 (2 GPUs) runs b for 0.5 s, replica 2 (1 GPU) has no
    work; the step takes 1.2 s: busy 1 and 1 GPU-s, idle 0.2 + 1.4 + 1.2 = 2.8 GPU-s, halved."""
    plan = make_plan(((TP1, 1), (TP2, 1), (TP1, 1)), n_tasks=2)
    step = _step(plan, [[_mb([(0, 1)], 256)], [_mb([(1, 4)], 256)], []])
    owed = task_gpu_seconds(step, _report((1.0, 0.5, 0.0), 1.2), plan, COST_MODEL, ("a", "b"))
    assert owed == pytest.approx({"a": 1.0 + 1.4, "b": 1.0 + 1.4})
    # An idle replica that still measured some busy time (a sync): it is idle for accounting, charged to all.
    assert task_gpu_seconds(step, _report((1.0, 0.5, 0.3), 1.2), plan, COST_MODEL, ("a", "b")) == pytest.approx(owed)


def test_a_mixed_micro_batch_is_split_by_each_task_alone():
    """One padded micro-batch, 1 row of a and 3 of b at 512 tokens: a's part is τ(a's row) / (τ(a) + τ(b))."""
    plan = make_plan(((TP1, 1),), n_tasks=2)
    step = _step(plan, [[_mb([(0, 1), (1, 3)], 512)]])
    alone = [COST_MODEL.shape_time(TP1, MicroBatchShape((512,) * n, 512)) for n in (1, 3)]
    owed = task_gpu_seconds(step, _report((2.0,), 2.0), plan, COST_MODEL, ("a", "b"))
    assert owed["a"] == pytest.approx(2.0 * alone[0] / sum(alone)) and owed["a"] + owed["b"] == pytest.approx(2.0)
    assert 0.25 < owed["a"] / 2.0 < 0.5  # more than its token share: the micro-batch's fixed cost is split too


def test_degenerate_steps():
    plan = make_plan(((TP1, 2),), n_tasks=2)
    step = _step(plan, [[_mb([(0, 1)], 128)], [_mb([(1, 1)], 128)]])
    # Nothing measured busy (an executor that times only the step): the estimates stand in.
    owed = task_gpu_seconds(step, _report((0.0, 0.0), 1.0), plan, COST_MODEL, ("a", "b"))
    assert owed == pytest.approx({"a": 1.0, "b": 1.0})
    # A busy time past the makespan (clock skew): still exact and non-negative.
    owed = task_gpu_seconds(step, _report((1.5, 0.2), 1.0), plan, COST_MODEL, ("a", "b"))
    assert sum(owed.values()) == pytest.approx(2.0) and min(owed.values()) > 0
    # No sequence at all: nobody to charge.
    empty = _step(plan, [[], []])
    assert task_gpu_seconds(empty, _report((0.0, 0.0), 0.1), plan, COST_MODEL, ("a", "b")) == {"a": 0.0, "b": 0.0}
    with pytest.raises(ValueError, match="reports 1 replicas"):
        task_gpu_seconds(step, _report((1.0,), 1.0), plan, COST_MODEL, ("a", "b"))
    with pytest.raises(ValueError, match="step 1"):
        task_gpu_seconds(step, _report((1.0, 1.0), 1.0, step=1), plan, COST_MODEL, ("a", "b"))
    with pytest.raises(ValueError, match="finite"):
        task_gpu_seconds(step, _report((float("nan"), 1.0), 1.0), plan, COST_MODEL, ("a", "b"))
    with pytest.raises(ValueError, match="outside"):
        task_gpu_seconds(step, _report((1.0, 1.0), 1.0), plan, COST_MODEL, ("a",))


def test_totals_over_steps():
    assert sum_task_gpu_seconds([{"a": 1.0, "b": 2.0}, {"b": 0.5, "c": 1.0}, {}]) == {"a": 1.0, "b": 2.5, "c": 1.0}
    assert list(sum_task_gpu_seconds([{"b": 1.0}, {"a": 1.0}])) == ["b", "a"]
