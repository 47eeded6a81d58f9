"""CostModel: stage time with head and pipeline transfers, replica time (LobRA Eq. 12), step overhead."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.cost_model import CostModel, Interconnect
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import FORWARD_SHARE, AffineTime, LayerTimeCoeffs, Link, MicroBatchShape
from lorafleet.specs.model import MODEL_PRESETS

MODEL = MODEL_PRESETS["llama2-7b"]
LAYER = LayerTimeCoeffs((1e-7, 0.0, 4e-3, 0.0, 0.0, 2.0))
LINK = Link(latency_ms=0.01, gb_per_s=100.0)
CM = CostModel(
    model=MODEL,
    layer_time={1: LAYER, 2: LAYER},
    max_tokens_table={ParallelConfig(1, 1): 2048, ParallelConfig(1, 4): 4096, ParallelConfig(2, 1): 4096},
    head_time={1: AffineTime(0.5, 1e-3), 2: AffineTime(0.25, 5e-4)},
    interconnect=Interconnect(LINK, Link(0.02, 10.0), LINK, gpus_per_node=8),
    optimizer_time=AffineTime(0.0, 1e-6),
    adapters=AdapterLoad.uniform(6, 16),
)


def test_bare_cost_model_is_lobra():
    bare = CostModel(model=MODEL, layer_time={1: LAYER}, max_tokens_table={ParallelConfig(1, 2): 2048})
    config = ParallelConfig(1, 2)
    assert bare.microbatch_time(config, 4, 512) == pytest.approx(LAYER(4, 512) * 16 / 1e3)
    assert bare.step_overhead(config) == 0.0
    mbs = [MicroBatchShape.padded(4, 512), MicroBatchShape.padded(1, 2048)]
    taus = [LAYER(4, 512) * 16 / 1e3, LAYER(1, 2048) * 16 / 1e3]
    assert bare.replica_time(config, mbs) == pytest.approx(sum(taus) + max(taus))


def test_stage_time_adds_head_and_pipeline_transfers():
    b, s = 2, 1024
    tokens = b * s
    one = ParallelConfig(1, 1)
    assert CM.microbatch_time(one, b, s) == pytest.approx((32 * LAYER(b, s) + 0.5 + 1e-3 * tokens) / 1e3)
    four = ParallelConfig(1, 4)
    p2p = 2 * LINK.transfer()(tokens * MODEL.hidden * 2)
    assert CM.microbatch_time(four, b, s) == pytest.approx((8 * LAYER(b, s) + 0.5 + 1e-3 * tokens + p2p) / 1e3)
    # Stages on two nodes use the inter-node link.
    spread = ParallelConfig(4, 4)
    cm = replace(CM, layer_time={**CM.layer_time, 4: LAYER}, head_time={**CM.head_time, 4: AffineTime()})
    slow = 2 * Link(0.02, 10.0).transfer()(tokens * MODEL.hidden * 2)
    assert cm.microbatch_time(spread, b, s) == pytest.approx((8 * LAYER(b, s) + slow) / 1e3)


def test_recompute_grows_the_blocks_not_the_head():
    """Recomputation re-runs every block's forward (c_i * (1 + FORWARD_SHARE_i)); the LM head runs once."""
    b, s, tokens = 2, 1024, 2048
    rc = ParallelConfig(1, 1, recompute=True)
    assert LAYER.recomputed().c == pytest.approx([c * (1 + f) for c, f in zip(LAYER.c, FORWARD_SHARE)])
    assert CM.microbatch_time(rc, b, s) == pytest.approx((32 * LAYER.recomputed()(b, s) + 0.5 + 1e-3 * tokens) / 1e3)


def test_microbatch_time_vectorises_and_empty_is_free():
    config = ParallelConfig(2, 1)
    b = np.array([0, 1, 8])
    s = np.array([512, 512, 256])
    t = CM.microbatch_time(config, b, s)
    assert t.shape == (3,) and t[0] == 0.0
    assert t[2] == pytest.approx(CM.microbatch_time(config, 8, 256))
    assert CM.packed_microbatch_time(config, []) == 0.0


def test_packed_and_padded_shapes():
    config = ParallelConfig(1, 1)
    padded = MicroBatchShape((100, 300), 300)
    packed = MicroBatchShape.packed([100, 300])
    assert CM.shape_time(config, padded) == pytest.approx(CM.microbatch_time(config, 2, 300))
    assert CM.shape_time(config, packed) == pytest.approx(CM.packed_microbatch_time(config, [100, 300]))
    assert CM.shape_time(config, packed) < CM.shape_time(config, padded)


def test_replica_time_is_lobra_eq_12_plus_overhead():
    config = ParallelConfig(1, 4)
    mbs = [MicroBatchShape.padded(2, 1024), MicroBatchShape.packed([500, 700]), MicroBatchShape.padded(8, 128)]
    taus = [CM.shape_time(config, mb) for mb in mbs]
    assert CM.replica_time(config, mbs) == pytest.approx(sum(taus) + 3 * max(taus) + CM.step_overhead(config))
    assert CM.replica_time(config, []) == 0.0


def test_a_pipeline_window_charges_less_bubble_with_many_tasks():
    """W = 1 is Eq. 12 whatever the tasks; W = 8 over micro-batches of many tasks (each task's
    micro-batches spread by more than pp - 1 others: no stall) pays the fill and drain once in 8 steps."""
    config = ParallelConfig(1, 4)
    mbs = [MicroBatchShape.padded(2, 512)] * 8
    tasks = [{k} for k in range(8)]
    taus = CM.stage_coeffs(config).shapes(mbs) / 1e3
    flushed = CM.replica_time(config, mbs, tasks)
    assert flushed == pytest.approx(CM.replica_time(config, mbs))
    assert flushed == pytest.approx(taus.sum() + 3 * taus.max() + CM.step_overhead(config))
    assert CM.bubble_slots(config, tasks, window=8) == pytest.approx(3 / 8)
    assert CM.replica_time(config, mbs, tasks, window=8) == pytest.approx(
        taus.sum() + 3 / 8 * taus.max() + CM.step_overhead(config)
    )
    assert CM.replica_time(config, mbs, tasks, window=8) < flushed
    # one task: every boundary stalls a whole drain, so the window gains nothing
    assert CM.replica_time(config, mbs, [{0}] * 8, window=8) == pytest.approx(flushed)
    # no pipeline, no bubble; the tasks must be one collection per micro-batch
    assert CM.bubble_slots(ParallelConfig(1, 1), tasks, window=8) == 0.0
    with pytest.raises(ValueError, match="7 task sets for 8 micro-batches"):
        CM.replica_time(config, mbs, tasks[:7], window=8)
    with pytest.raises(ValueError, match="at least one step"):
        CM.replica_time(config, mbs, tasks, window=0)


def test_step_overhead_grows_with_tasks_and_rank_and_shrinks_with_gpus():
    config = ParallelConfig(1, 1)
    params = CM.adapters.total_params(MODEL)
    expected = LINK.allreduce(2)(params * 2) + 1e-6 * params
    assert CM.step_overhead(config) == pytest.approx(expected / 1e3)
    more_tasks = replace(CM, adapters=AdapterLoad.uniform(12, 16))
    higher_rank = replace(CM, adapters=AdapterLoad.uniform(6, 64))
    assert more_tasks.step_overhead(config) > CM.step_overhead(config)
    assert higher_rank.step_overhead(config) > CM.step_overhead(config)
    assert CM.step_overhead(ParallelConfig(1, 4)) < CM.step_overhead(config)
    assert replace(CM, sync_replicas=1).step_overhead(config) == pytest.approx(1e-6 * params / 1e3)


def test_configs_need_time_and_memory():
    assert CM.configs == [ParallelConfig(1, 1), ParallelConfig(1, 4), ParallelConfig(2, 1)]
    assert CM.max_tokens(ParallelConfig(8, 1)) == 0


def test_adapter_parameter_count_matches_lobra_notes():
    """LobRA notes: about 1.18M adapter parameters per layer per task for 7B at rank 16 (gate+up fused there)."""
    per_task = AdapterLoad.uniform(1, 16).params_per_layer(MODEL)
    assert per_task == pytest.approx(1.18e6, rel=0.15)


def test_a_measured_forward_prices_an_evaluation_instead_of_the_shares():
    """With a profile's forward coefficients, τF = L/pp forward blocks + the head's forward + one pipeline message,
    and T_F = Σ τF + (pp - 1) max τF; a TP degree without them keeps the shares; a fleet's pool prices its own."""
    forward = LayerTimeCoeffs((3e-8, 0.0, 1e-3, 0.0, 0.0, 0.7))
    cm = replace(CM, forward_layer_time={1: forward}, forward_head_time={1: AffineTime(0.2, 4e-4)})
    mbs = [MicroBatchShape.padded(2, 1024), MicroBatchShape.packed([300, 700])]
    tokens = np.array([2048, 1000])
    blocks = np.array([forward(2, 1024), forward.packed([300, 700])])
    one, four = ParallelConfig(1, 1), ParallelConfig(1, 4)
    tau = 32 * blocks + 0.2 + 4e-4 * tokens
    assert cm.forward_time(one, mbs) == pytest.approx(tau.sum() / 1e3)
    tau = 8 * blocks + 0.2 + 4e-4 * tokens + LINK.transfer()(tokens * MODEL.hidden * 2)
    assert cm.forward_time(four, mbs) == pytest.approx((tau.sum() + 3 * tau.max()) / 1e3)
    assert cm.forward_time(one.with_recompute(True), mbs) == cm.forward_time(one, mbs)  # nothing kept to recompute
    two = ParallelConfig(2, 1)
    assert cm.forward_time(two, mbs) == CM.forward_time(two, mbs)  # not measured: the shares
    shares = CM.stage_coeffs(two).forward().shapes(mbs).sum() / 1e3
    assert CM.forward_time(two, mbs) == pytest.approx(shares)
    fleet = CostModel.of_pools({"a": cm, "b": CM})
    assert fleet.forward_time(one.in_pool("a"), mbs) == cm.forward_time(one, mbs)
    assert fleet.forward_time(one.in_pool("b"), mbs) == CM.forward_time(one, mbs)


def test_an_adapter_load_sums_its_tasks_once_per_model(monkeypatch):
    """A plan asks a load's parameters per block ~150 times; the sum over its tasks runs once per model (work count),
    and a load made by ``replace`` sums its own tasks."""
    from lorafleet.costmodel.adapters import TaskAdapter

    calls = []
    per_task = TaskAdapter.params_per_layer
    monkeypatch.setattr(TaskAdapter, "params_per_layer", lambda self, model: calls.append(1) or per_task(self, model))
    load = AdapterLoad.uniform(4)
    seven, seventy = MODEL_PRESETS["llama2-7b"], MODEL_PRESETS["llama2-70b"]
    first = [load.params_per_layer(seven) for _ in range(3)]
    assert first == [4 * per_task(load.tasks[0], seven)] * 3 and len(calls) == 4
    assert load.params_per_layer(seventy) == 4 * per_task(load.tasks[0], seventy) and len(calls) == 8
    assert replace(load, tasks=load.tasks[:2]).params_per_layer(seven) == first[0] // 2 and len(calls) == 10
