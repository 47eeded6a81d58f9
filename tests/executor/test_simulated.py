"""The simulated executor (``executor.simulated``) on the step loop: the cost model's prediction without noise,
a window of step plans, stragglers, failures and seeded noise."""

from __future__ import annotations

import pytest

from lorafleet.executor.simulated import FailureSpec, SimulatedExecutor, SimulationOptions
from lorafleet.loop import PolicySource, run_loop
from lorafleet.sampling import sample_global_batch


def _source(workload, cost_model, result):
    phase = result.schedule.phases[0]
    return PolicySource(lambda s: sample_global_batch(workload, s), phase.plan, cost_model)


def test_noise_free_simulation_equals_the_cost_model(small):
    workload, cost_model, result = small
    plan = result.schedule.phases[0].plan
    executor = SimulatedExecutor(plan, cost_model, [t.name for t in workload.tasks])
    source = _source(workload, cost_model, result)
    for report in run_loop(source, executor, range(3)):
        step_plan = source.plan_for(report.step)
        assert report.makespan_s == pytest.approx(step_plan.estimated_makespan_s, rel=1e-9)
        assert sum(report.task_tokens.values()) == step_plan.tokens  # nothing dropped


def test_a_window_of_steps_is_simulated_as_the_dispatcher_priced_it():
    """A pipelined replica under W = 8: each replica's simulated busy time is the dispatcher's estimate,
    both priced with the micro-batches' tasks; ``run_steps`` runs a window of step plans in order."""
    from dataclasses import replace

    from lorafleet.dispatch import solve_step
    from lorafleet.presets import FLUSHED_PADDING, TP1, TP2_PP2, lobra_7b_cost_model, lognormal_batch, make_plan

    plan = make_plan(((TP1, 2), (TP2_PP2, 2)), n_tasks=6, policy=replace(FLUSHED_PADDING, pipeline_window=8))
    cost_model = lobra_7b_cost_model()
    steps = [
        solve_step(lognormal_batch(s, max_len=4096), plan, cost_model, plan.policy.options, window=8).plan
        for s in range(3)
    ]
    executor = SimulatedExecutor(plan, cost_model, plan.tasks)
    reports = executor.run_steps(steps)
    assert [r.step for r in reports] == [0, 1, 2]
    assert reports == [executor.run_step(p) for p in steps]
    for report, step in zip(reports, steps, strict=True):
        assert report.replica_busy_s == pytest.approx([w.estimated_time_s for w in step.work], rel=1e-12)
    flushed = SimulatedExecutor(replace(plan, policy=FLUSHED_PADDING), cost_model, executor.task_names)
    for report, step in zip(flushed.run_steps(steps), steps, strict=True):
        pipelined = [k for k, r in enumerate(plan.replicas) if r.config.pp > 1 and step.work[k].microbatches]
        assert pipelined and all(report.replica_busy_s[k] > step.work[k].estimated_time_s for k in pipelined)


def test_stragglers_failures_and_noise(small):
    workload, cost_model, result = small
    plan = result.schedule.phases[0].plan
    names = [t.name for t in workload.tasks]
    source = _source(workload, cost_model, result)
    base = run_loop(source, SimulatedExecutor(plan, cost_model, names), range(4))
    slow = run_loop(source, SimulatedExecutor(plan, cost_model, names, SimulationOptions(slowdown={0: 2.0})), range(4))
    assert all(s.replica_busy_s[0] == pytest.approx(2 * b.replica_busy_s[0]) for s, b in zip(slow, base))
    failing = SimulationOptions(failures=(FailureSpec(step=2, replica_id=1, restart_s=30.0),))
    failed = run_loop(source, SimulatedExecutor(plan, cost_model, names, failing), range(4))
    assert failed[2].failed_replicas == (1,) and failed[2].makespan_s >= 30.0
    assert [r.makespan_s for i, r in enumerate(failed) if i != 2] == [
        r.makespan_s for i, r in enumerate(base) if i != 2
    ]
    noisy = SimulationOptions(noise_sigma=0.05, seed=7)
    one = run_loop(source, SimulatedExecutor(plan, cost_model, names, noisy), range(3))
    two = run_loop(source, SimulatedExecutor(plan, cost_model, names, noisy), range(3))
    assert [r.makespan_s for r in one] == [r.makespan_s for r in two]  # deterministic given the seed
    assert [r.makespan_s for r in one] != [r.makespan_s for r in base[:3]]
    with pytest.raises(ValueError):
        SimulationOptions(slowdown={0: 0.5})
