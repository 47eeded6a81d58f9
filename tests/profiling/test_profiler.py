"""``measure_profile`` end to end on a tiny grid: 2 gloo processes, TP1 and TP2, PP emulated for memory;
and one process (the world of a one-GPU machine) in bf16."""

from __future__ import annotations

import pytest

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.build import profile_cost_model
from lorafleet.costmodel.check import heldout_comparisons
from lorafleet.costmodel.fitted import fit_profile
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.executor.torch.precision import Precision
from lorafleet.profiling.run import MIB, ProfileSettings, measure_profile
from lorafleet.specs.model import MODEL_PRESETS

TINY = MODEL_PRESETS["tiny-llama"]
CONFIGS = (ParallelConfig(1, 1), ParallelConfig(1, 2), ParallelConfig(2, 1), ParallelConfig(1, 1, recompute=True))


def tiny_settings(**changes) -> ProfileSettings:
    """The tiny grid every test here profiles: 1-2 rows of 16-64 tokens, one repeat, two tasks; the ranks forked
    from this process (its imports reused: a spawned rank imports torch and transformers anew)."""
    fields = dict(
        model=TINY,
        configs=CONFIGS,
        adapters=AdapterLoad.uniform(2, 4),
        seq_lens=(16, 64),
        mbs=(1, 2),
        max_grid_tokens=128,
        packed=1,
        heldout=1,
        replica_steps=1,
        warmup=0,
        repeats=1,
        rounds=1,
        memory_budget_bytes=8 * MIB,
        comm_sizes=(1024, 16384),
        command="pytest",
        start_method="fork",
    )
    return ProfileSettings(**{**fields, **changes})


@pytest.fixture(scope="module")
def profile():
    return measure_profile(tiny_settings())


def test_records_cover_every_kind(profile):
    rec = profile.records
    for tp in (1, 2):
        layer = [r for r in rec.layer if r.tp == tp]
        assert len([r for r in layer if not r.heldout]) == 5  # the 2 x 2 grid and one packed micro-batch
        assert {r.packed is None for r in layer if r.heldout} == {True, False}  # held-out padded and packed
        assert len([r for r in rec.head if r.tp == tp]) == 4  # distinct grid token counts: 16, 32, 64, 128
        # The forward alone on the same shapes and token counts (an evaluation's work), and cheaper.
        forward = {(r.mbs, r.seq_len, r.packed): r for r in rec.layer_forward if r.tp == tp}
        assert set(forward) == {(r.mbs, r.seq_len, r.packed) for r in layer}
        assert [r.heldout for r in rec.layer_forward if r.tp == tp] == [r.heldout for r in layer]
        assert sorted(r.tokens for r in rec.head_forward if r.tp == tp) == [16, 32, 64, 128]
    assert sum(r.time_ms for r in rec.layer_forward) < sum(r.time_ms for r in rec.layer)
    assert sorted((r.tp, r.sync_replicas) for r in rec.replica) == [(1, 1), (1, 2), (2, 1)]
    assert len(rec.p2p) == len(rec.allreduce) == 2 and len(rec.optimizer) == 2
    assert all(r.time_ms > 0 for r in rec.layer + rec.head + rec.replica)
    assert (
        profile.kind == "measured" and profile.dtype_bytes == 4 and profile.settings["memory_budget_bytes"] == 8 * MIB
    )


def test_max_tokens_are_searched_against_the_budget(profile):
    m = {r.config: r for r in profile.memory}
    assert set(m) == set(CONFIGS)
    assert all(r.max_tokens > 0 for r in m.values())
    # A TP2 rank holds half the FFN activations; a PP2 stage half the blocks.
    assert m[ParallelConfig(2, 1)].max_tokens > m[ParallelConfig(1, 1)].max_tokens
    assert m[ParallelConfig(1, 2)].max_tokens > m[ParallelConfig(1, 1)].max_tokens
    # Recomputation keeps one hidden state per block instead of every activation.
    assert m[ParallelConfig(1, 1, recompute=True)].max_tokens > 1.5 * m[ParallelConfig(1, 1)].max_tokens
    for r in m.values():  # the fitted memory line agrees with the search (which stops within 1/16)
        assert r.line.max_tokens() == pytest.approx(r.max_tokens, rel=0.15)


def test_fit_and_check_run_on_measured_records(profile):
    fitted = fit_profile(profile)
    assert set(fitted.coefficients.layer_ms) == set(fitted.coefficients.forward_layer_ms) == {1, 2}
    assert min(min(c) for c in fitted.coefficients.layer_ms.values()) >= 0
    assert "forward_layer_cv" in fitted.quality
    cm = profile_cost_model(fitted, TINY)
    assert cm.configs == sorted(CONFIGS)
    for config in cm.configs:  # the measured forward prices an evaluation, not the assumed shares
        mbs = [MicroBatchShape.padded(2, 64), MicroBatchShape.packed([16, 40])]
        shares = cm.stage_coeffs(config.with_recompute(False)).forward().shapes(mbs)
        assert cm.forward_stage_coeffs(config).shapes(mbs) != pytest.approx(shares)
    assert cm.step_overhead(ParallelConfig(1, 1)) > 0  # the optimizer step was measured
    kinds = {c.kind for c in heldout_comparisons(fitted, TINY)}
    assert kinds == {"layer", "packed", "forward", "replica"}


def test_one_device_profiles_tp1_alone_in_bf16():
    """The path of a machine with one GPU, on one CPU process: a world of one, no transfer records,
    the lone TP1 replica's steps timed once (not again as a fleet of one), a bf16 base (fp32 adapters)."""
    settings = tiny_settings(
        configs=(ParallelConfig(1, 1), ParallelConfig(1, 2)),
        memory_budget_bytes=4 * MIB,
        transfers=False,
        precision=Precision.BF16,
    )
    assert settings.world == 1
    profile = measure_profile(settings)
    rec = profile.records
    assert rec.p2p == rec.allreduce == () and len(rec.optimizer) == 2
    assert [(r.tp, r.sync_replicas) for r in rec.replica] == [(1, 1)]
    assert profile.dtype_bytes == 2 and profile.settings["dtype"] == "bf16" and profile.settings["processes"] == 1
    assert {r.config for r in profile.memory} == set(settings.configs) and all(r.max_tokens > 0 for r in profile.memory)
    fitted = fit_profile(profile)
    assert fitted.coefficients.grad_sync.gb_per_s is None  # no all-reduce measured: a free link
    profile_cost_model(fitted, TINY)
