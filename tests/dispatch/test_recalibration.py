"""Online recalibration: the factors' math, their effect on the dispatch, and a straggler in the simulator."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from lorafleet.dispatch import dispatch_step, task_tokens_per_replica
from lorafleet.dispatch.load import config_classes
from lorafleet.dispatch.recalibration import Recalibrator
from lorafleet.executor.simulated import FailureSpec, SimulatedExecutor, SimulationOptions
from lorafleet.loop import PolicySource, run_loop
from lorafleet.plans import ReplicaWork, StepPlan, StepReport
from lorafleet.presets import LOBRA_7B_PLAN, TP1, lobra_7b_cost_model, lognormal_batch, make_plan
from lorafleet.specs.dispatch import DispatchOptions, DispatchPolicy, MicroBatchMode, Recalibration

COST_MODEL = lobra_7b_cost_model()
PLAN = replace(
    make_plan(LOBRA_7B_PLAN), policy=DispatchPolicy(options=DispatchOptions(microbatch_mode=MicroBatchMode.PACKING))
)


def _step(predicted, speed=()) -> StepPlan:
    from lorafleet.plans import MicroBatch

    mb = MicroBatch(seq_ids=(0,), task_ids=(0,), lengths=(10,), padded_len=None)
    work = tuple(
        ReplicaWork(replica_id=r, microbatches=(mb,) if p > 0 else (), estimated_time_s=p)
        for r, p in enumerate(predicted)
    )
    return StepPlan(step=0, bucket_boundaries=(16,), work=work, estimated_makespan_s=max(predicted), speed=tuple(speed))


def _report(measured, failed=()) -> StepReport:
    return StepReport(step=0, replica_busy_s=tuple(measured), makespan_s=max(measured), failed_replicas=tuple(failed))


def test_first_observation_is_taken_whole_then_smoothed():
    cal = Recalibrator(3, Recalibration(smoothing=0.5))
    assert cal.factors == (1.0, 1.0, 1.0)
    cal.observe(_step([1.0, 2.0, 1.0]), _report([2.0, 2.0, 1.0]))
    assert cal.factors == pytest.approx((2.0, 1.0, 1.0))
    cal.observe(_step([1.0, 2.0, 1.0]), _report([1.0, 2.0, 1.0]))
    # the debiased mean of the ratios: (0.25 * 2 + 0.5 * 1) / (1 - 0.5^2)
    assert cal.factors[0] == pytest.approx((0.25 * 2 + 0.5 * 1) / 0.75)


def test_prediction_is_taken_before_the_correction():
    """A plan priced at speed 2 predicted 2x its model; the factor is measured against the model."""
    cal = Recalibrator(1)
    cal.observe(_step([4.0], speed=[2.0]), _report([4.0]))
    assert cal.factors == pytest.approx((2.0,))


def test_the_fleets_scale_is_unbounded_a_replicas_departure_is_bounded():
    cal = Recalibrator(4, Recalibration(bound=3.0))
    cal.observe(_step([1.0, 1.0, 1.0, 1.0]), _report([50.0, 40.0, 1000.0, 60.0]))
    assert cal.scale == pytest.approx(55.0)  # the model is 55x off for everyone: corrected in full
    assert cal.factors == pytest.approx((50.0, 40.0, 3 * 55.0, 60.0))  # replica 2: at most 3x its peers


def test_bounded_and_skipping_what_says_nothing():
    cal = Recalibrator(3, Recalibration(bound=3.0))
    cal.observe(_step([1.0, 0.0, 1.0]), _report([2.0, 5.0, 9.0], failed=[2]))
    assert cal.factors == pytest.approx((2.0, 2.0, 2.0))  # idle and failed replicas take the fleet's scale
    off = Recalibrator(1, Recalibration(enabled=False))
    off.observe(_step([1.0]), _report([2.0]))
    assert off.factors is None
    state = cal.state_dict()
    again = Recalibrator(3, Recalibration(bound=3.0))
    again.load_state_dict(state)
    assert again.factors == cal.factors
    other = Recalibrator(2)
    other.load_state_dict(state)  # another deployment's replicas: they start from the pool's scale (#29)
    assert other.factors == pytest.approx((2.0, 2.0))


def test_each_pool_has_its_scale_and_a_replica_not_yet_observed_starts_from_its_siblings():
    """#29: the A100 pool's model is 2x off, the H100's 0.5x: an idle H100 replica is priced at its
    siblings' 0.5, not at the fleet's median; each replica departs from its own pool's scale."""
    pools = ["a100", "a100", "h100", "h100", "h100"]
    cal = Recalibrator(5, Recalibration(bound=3.0), pools=pools)
    cal.observe(_step([1.0, 1.0, 1.0, 1.0, 0.0]), _report([2.0, 2.0, 0.5, 3.0, 0.0]))
    assert cal.pool_scales() == pytest.approx({"a100": 2.0, "h100": 1.75})
    assert cal.factors[4] == pytest.approx(1.75)  # the fleet's median would be 2.0
    one = Recalibrator(5, Recalibration(bound=3.0))  # one pool: the old rule, every replica around the fleet's g
    one.observe(_step([1.0, 1.0, 1.0, 1.0, 0.0]), _report([2.0, 2.0, 0.5, 3.0, 0.0]))
    assert one.factors[4] == pytest.approx(2.0)
    h100 = Recalibrator(3, Recalibration(bound=3.0), pools=["a100", "h100", "h100"])
    h100.observe(_step([1.0, 1.0, 0.0]), _report([2.0, 0.5, 0.0]))
    assert h100.factors == pytest.approx((2.0, 0.5, 0.5))  # the idle H100 replica: its sibling's, not 1.25


def test_a_re_planned_deployment_starts_each_pool_from_what_it_measured():
    old = Recalibrator(3, pools=["a100", "h100", "h100"])
    old.observe(_step([1.0, 1.0, 1.0]), _report([2.0, 0.5, 0.5]))
    state = old.state_dict()
    assert state["pool_scales"] == pytest.approx({"a100": 2.0, "h100": 0.5})
    new = Recalibrator(4, pools=["a100", "h100", "h100", "l40s"])
    new.load_state_dict(state)
    # l40s was never measured: the fleet's scale (the median of the new deployment's observations, none yet: 1)
    assert new.factors == pytest.approx((2.0, 0.5, 0.5, 1.0))
    carried = Recalibrator(2, pools=["h100", "a100"], prior=old.measured_pool_scales())
    assert carried.factors == pytest.approx((0.5, 2.0))
    resumed = Recalibrator(3, pools=["a100", "h100", "h100"])
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    legacy = Recalibrator(3)  # a checkpoint written before pools: one pool, its averages kept
    legacy.load_state_dict({"average": state["average"], "observed": state["observed"]})
    assert legacy.state_dict()["average"] == state["average"]


@pytest.mark.parametrize(
    "bad", [dict(smoothing=1.0), dict(smoothing=-0.1), dict(bound=0.5), dict(bound=math.inf), dict(smoothing=math.nan)]
)
def test_bad_options(bad):
    from lorafleet.errors import InputError

    with pytest.raises(InputError):
        Recalibration(**bad)


def test_speed_splits_a_config_class_only_beyond_the_tolerance():
    speed = [1.0, 1.03, 0.99, 2.0, 1.0, 1.0, 1.0, 1.0]
    classes = config_classes(PLAN, COST_MODEL, speed)
    tp1 = [c for c in classes if c.config == TP1]
    assert sorted(c.replicas for c in tp1) == [(0, 1, 2, 4, 5), (3,)]
    assert {c.replicas: c.time_scale for c in tp1}[(3,)] == 2.0
    assert config_classes(PLAN, COST_MODEL, [1.0] * 8) == config_classes(PLAN, COST_MODEL)


def test_unit_speed_changes_nothing_and_a_slow_replica_is_priced_slower():
    batch = lognormal_batch(1)
    plain = dispatch_step(batch, PLAN, COST_MODEL)
    unit = dispatch_step(batch, PLAN, COST_MODEL, speed=[1.0] * 8)
    assert [w.microbatches for w in unit.work] == [w.microbatches for w in plain.work]
    assert unit.speed == (1.0,) * 8 and plain.speed == ()
    slow = dispatch_step(batch, PLAN, COST_MODEL, speed=[2.0] + [1.0] * 7)
    tokens = task_tokens_per_replica(slow, 6).sum(axis=1)
    before = task_tokens_per_replica(plain, 6).sum(axis=1)
    assert tokens[0] < 0.65 * before[0]
    assert slow.work[0].estimated_time_s == pytest.approx(
        2.0 * COST_MODEL.replica_time(PLAN.replicas[0].config, [mb.shape for mb in slow.work[0].microbatches])
    )
    assert slow.base_estimate(0) == pytest.approx(slow.work[0].estimated_time_s / 2.0)


def _simulate(options: SimulationOptions, steps: int, speed_oracle=None, recalibrate=True):
    source = PolicySource(lognormal_batch, PLAN, COST_MODEL)
    executor = SimulatedExecutor(PLAN, COST_MODEL, [f"task{k}" for k in range(6)], options)
    if speed_oracle is not None:  # the dispatcher knows the true speeds from the start
        plans = [source.plan_for(s, speed_oracle) for s in range(steps)]
        return [executor.run_step(p) for p in plans], plans
    recal = Recalibrator(len(PLAN.replicas), PLAN.policy.recalibration if recalibrate else Recalibration(enabled=False))
    seen = []
    reports = run_loop(source, executor, range(steps), lambda r, p: seen.append(p), recal)
    return reports, seen


def test_a_straggler_gets_proportionally_less_work_within_three_steps_and_the_fleet_recovers():
    """Replica 0 (one of six TP1 replicas) runs 2x slow: from step 1 on (the first dispatch after its first
    report) it holds about half the tokens of a healthy peer, and the steady step time is within 5% of
    the ideal for the fleet's remaining capacity (a dispatcher told the true speeds from step 0)."""
    slow = SimulationOptions(slowdown={0: 2.0})
    steps = 8
    reports, plans = _simulate(slow, steps)
    static, _ = _simulate(slow, steps, recalibrate=False)
    ideal, _ = _simulate(slow, steps, speed_oracle=[2.0] + [1.0] * 7)
    share = np.array([task_tokens_per_replica(p, 6).sum(axis=1) for p in plans])  # (steps, replicas)
    peers = share[:, 1:6].mean(axis=1)
    assert share[0, 0] == pytest.approx(peers[0], rel=0.2)  # step 0: nothing measured yet
    for step in range(1, 3):
        assert 0.35 < share[step, 0] / peers[step] < 0.65
    steady = slice(3, steps)
    ours = np.mean([r.makespan_s for r in reports[steady]])
    best = np.mean([r.makespan_s for r in ideal[steady]])
    assert ours <= 1.05 * best
    assert np.mean([r.makespan_s for r in static[steady]]) > 1.25 * best  # without it the straggler sets the pace


def test_noise_free_healthy_fleet_is_left_alone():
    reports, plans = _simulate(SimulationOptions(), 4)
    assert all(p.speed == pytest.approx((1.0,) * 8) for p in plans)


def test_a_failed_step_is_not_taken_for_slowness():
    reports, plans = _simulate(SimulationOptions(failures=(FailureSpec(step=0, replica_id=2, restart_s=30.0),)), 3)
    assert plans[1].speed == pytest.approx((1.0,) * 8)


def test_a_moved_deployment_keeps_what_its_staying_replicas_measured():
    """A live change's move (#28 with #29's pools): a replica that stays keeps its own average and count, a new
    one starts from its pool's measured scale; the new recalibrator has the new plan's pools (a move's
    recalibrator built from the checkpoint's state remapped every entry by replica, the pools' scales too, and
    failed with a KeyError)."""
    from tests.helpers import fleet_harness as h

    old = Recalibrator.for_plan(h.plan_of((1, 1), (1, 1), (1, 1)))
    old.observe(_step([1.0, 1.0, 1.0]), _report([2.0, 3.0, 4.0]))
    new = old.moved(h.plan_of((1, 1), (2, 1), (1, 1), (1, 1)), [2, None, None, 0])
    assert new.factors == pytest.approx((4.0, 3.0, 3.0, 2.0))
    assert new.state_dict()["observed"] == [1, 0, 0, 1]
    assert new.state_dict()["pools"] == [""] * 4
