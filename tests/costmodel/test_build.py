"""Builders: analytic from a datasheet, from a profile file, and the adapter load as an input."""

from __future__ import annotations

import pytest

from lorafleet.costmodel import (
    AdapterLoad,
    ParallelConfig,
    analytic_cost_model,
    analytic_profile,
    load_cost_model,
    write_profile,
)
from lorafleet.costmodel.build import profile_cost_model
from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.lora import Quantization
from lorafleet.specs.model import MODEL_PRESETS
from lorafleet.specs.recompute import RecomputePolicy

LLAMA7B = MODEL_PRESETS["llama2-7b"]
SIX = AdapterLoad.uniform(6, 16)
CLUSTER = ClusterSpec(gpu="A100-40GB", nodes=2, gpus_per_node=8)


def test_no_profile_means_analytic():
    cm = load_cost_model(None, LLAMA7B, CLUSTER, SIX)
    assert cm.source == "analytic:A100-40GB"
    nf4 = load_cost_model(None, LLAMA7B, CLUSTER, SIX, quantize=Quantization.NF4)
    assert nf4.source == "analytic:A100-40GB over nf4" == nf4.origin.describe()  # the origin names the base
    assert cm.configs and all(cm.max_tokens(c) > 0 for c in cm.configs)
    assert ParallelConfig(4, 1) in cm.configs  # TP4 exists although LobRA's CSV has no TP4 rows
    assert max(c.n_gpus for c in cm.configs) <= CLUSTER.n_gpus
    with pytest.raises(ValueError):
        load_cost_model(None, LLAMA7B, None, SIX)


def test_recompute_policy_picks_the_configs():
    every = load_cost_model(None, LLAMA7B, CLUSTER, SIX)
    off = load_cost_model(None, LLAMA7B, CLUSTER, SIX, recompute=RecomputePolicy.OFF)
    on = load_cost_model(None, LLAMA7B, CLUSTER, SIX, recompute=RecomputePolicy.ON)
    assert off.configs and not any(c.recompute for c in off.configs)
    assert on.configs and all(c.recompute for c in on.configs)
    assert set(every.configs) == set(off.configs) | set(on.configs)
    for config in off.configs:  # same layout: far more tokens, every block term slower by its forward share
        rc = config.with_recompute()
        assert every.max_tokens(rc) > 8 * every.max_tokens(config)
        ratio = every.microbatch_time(rc, 1, 2048) / every.microbatch_time(config, 1, 2048)
        assert 1 + 2 / 7 < ratio < 1.5


def test_a_profile_without_recompute_configs_refuses_policy_on(tmp_path):
    profile = analytic_profile(LLAMA7B, CLUSTER, SIX)
    plain = profile.model_copy(update={"memory": tuple(r for r in profile.memory if not r.recompute)})
    assert not any(c.recompute for c in profile_cost_model(plain, LLAMA7B).configs)
    with pytest.raises(InputError, match="recompute=on"):
        profile_cost_model(plain, LLAMA7B, recompute=RecomputePolicy.ON, source="p.json")


def test_a_profile_file_gives_the_same_model(tmp_path):
    path = tmp_path / "a100.json"
    write_profile(analytic_profile(LLAMA7B, CLUSTER, SIX), path)
    from_file = load_cost_model(path, LLAMA7B, CLUSTER, SIX)
    direct = analytic_cost_model(LLAMA7B, CLUSTER, SIX)
    assert from_file.max_tokens_table == direct.max_tokens_table
    config = ParallelConfig(2, 2)
    assert from_file.microbatch_time(config, 4, 1024) == pytest.approx(direct.microbatch_time(config, 4, 1024))
    assert from_file.step_overhead(config) == pytest.approx(direct.step_overhead(config))


def test_adapter_load_moves_memory_and_overheads_of_a_profile(tmp_path):
    profile = analytic_profile(LLAMA7B, CLUSTER, SIX)
    base = profile_cost_model(profile, LLAMA7B)
    twelve = profile_cost_model(profile, LLAMA7B, AdapterLoad.uniform(12, 16))
    config = ParallelConfig(1, 1)
    assert twelve.max_tokens(config) < base.max_tokens(config)
    assert twelve.step_overhead(config) > base.step_overhead(config)
    # Recomputing analytically for 12 tasks lands on the same M.
    assert twelve.max_tokens(config) == pytest.approx(
        analytic_cost_model(LLAMA7B, CLUSTER, AdapterLoad.uniform(12, 16)).max_tokens(config), abs=2
    )


def test_profile_must_match_model_and_gpu(tmp_path):
    path = tmp_path / "a100.json"
    write_profile(analytic_profile(LLAMA7B, CLUSTER, SIX), path)
    with pytest.raises(InputError, match="model"):
        load_cost_model(path, MODEL_PRESETS["llama2-13b"], CLUSTER, SIX)
    with pytest.raises(InputError, match="gpu"):
        load_cost_model(path, LLAMA7B, ClusterSpec(gpu="H100-80GB", nodes=2, gpus_per_node=8), SIX)


def test_a_smaller_cluster_drops_configs_it_cannot_run(tmp_path):
    path = tmp_path / "a100.json"
    write_profile(analytic_profile(LLAMA7B, CLUSTER, SIX), path)
    small = ClusterSpec(gpu="A100-40GB", nodes=1, gpus_per_node=4)
    cm = load_cost_model(path, LLAMA7B, small, SIX)
    assert cm.configs and max(c.n_gpus for c in cm.configs) <= 4 and max(c.tp for c in cm.configs) <= 4


def test_what_if_other_hardware():
    h100 = analytic_cost_model(LLAMA7B, ClusterSpec(gpu="H100-80GB", nodes=2, gpus_per_node=8), SIX)
    a100 = analytic_cost_model(LLAMA7B, CLUSTER, SIX)
    config = ParallelConfig(1, 1)
    assert h100.max_tokens(config) > a100.max_tokens(config)
    assert h100.microbatch_time(config, 1, 2048) < a100.microbatch_time(config, 1, 2048)
