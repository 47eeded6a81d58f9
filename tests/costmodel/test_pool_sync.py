"""The adapters' gradient all-reduce of a deployment runs over its replicas (#43): on one pool it syncs on that
pool's own ``grad_sync`` link, so a deployment on one pool of a fleet costs what that pool alone prices; a
deployment over two pools crosses them, on each pool's inter-node link (``CostModel.spanning``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lorafleet.assemble import workload_cost_model
from lorafleet.costmodel.time_model import MS_PER_S
from lorafleet.dispatch import dispatch_step
from lorafleet.executor.simulated import SimulatedExecutor
from lorafleet.sampling import sample_global_batch
from tests.helpers.pools import pools_fleet

SYNC_REPLICAS = 4
"""``pools_fleet``'s cost model syncs over four replicas."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return pools_fleet(tmp_path_factory.mktemp("pools"))


def test_a_deployment_on_one_pool_of_a_fleet_costs_what_that_pool_alone_prices(fleet):
    """The A100 pool is one node, so its own sync is intra-node: a deployment on it alone, dispatched by the
    fleet's model, gets the same step, replica by replica, bit for bit, as by the A100 pool's own model."""
    workload, cluster, cost_model, plan = fleet
    alone = workload_cost_model(workload, cluster.only("a100"), sync_replicas=SYNC_REPLICAS)
    on_a100 = replace(plan, replicas=tuple(r for r in plan.replicas if r.pool == "a100"))
    assert on_a100.replicas, "the fleet's plan has an A100 replica"
    for step in range(2):
        batch = sample_global_batch(workload, 0, step)
        in_fleet, by_pool = dispatch_step(batch, on_a100, cost_model), dispatch_step(batch, on_a100, alone)
        assert [w.estimated_time_s for w in in_fleet.work] == [w.estimated_time_s for w in by_pool.work]
        assert in_fleet.estimated_makespan_s == by_pool.estimated_makespan_s
    config = on_a100.replicas[0].config
    assert cost_model.spanning(["a100", "a100"]).step_overhead(config) == alone.step_overhead(config)


def test_a_deployment_on_two_pools_pays_the_crossing_link(fleet):
    """Spanning both pools, the A100 replica's all-reduce runs on the A100s' inter-node link: its overhead is the
    ring over that link, dearer than the intra-node one it pays alone; the dispatcher and the simulated executor
    price every replica of the two-pool plan so."""
    workload, _, cost_model, plan = fleet
    a100 = next(r.config for r in plan.replicas if r.pool == "a100")
    pool, layout = cost_model.pool_model(a100)
    crossing = cost_model.spanning(r.pool for r in plan.replicas)
    assert crossing.spans_pools and cost_model.spanning(["h100"]) is cost_model
    params = pool.adapter_params_per_device(layout)
    ring = pool.interconnect.p2p_inter_node.allreduce(SYNC_REPLICAS)(params * pool.activation_bytes)
    expected = (ring + pool.optimizer_time(params)) / MS_PER_S
    assert crossing.step_overhead(a100) == pytest.approx(expected, rel=1e-12)
    assert crossing.step_overhead(a100) > cost_model.step_overhead(a100) == pool.step_overhead(layout)

    batch = sample_global_batch(workload, 0, 0)
    step = dispatch_step(batch, plan, cost_model)
    (report,) = SimulatedExecutor(plan, cost_model, [t.name for t in workload.tasks]).run_steps([step])
    for replica, work, simulated in zip(plan.replicas, step.work, report.replica_busy_s, strict=True):
        mbs = work.microbatches
        priced = crossing.replica_time(
            replica.config, [m.shape for m in mbs], [m.task_ids for m in mbs], window=plan.policy.pipeline_window
        )
        assert work.estimated_time_s == pytest.approx(priced, rel=1e-12) == simulated
