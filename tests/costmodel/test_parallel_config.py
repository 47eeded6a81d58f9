"""ParallelConfig and its validity for a model and a cluster."""

from __future__ import annotations

import pytest

from lorafleet.costmodel.parallel_config import ParallelConfig, config_problems, enumerate_configs
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.model import MODEL_PRESETS

LLAMA7B = MODEL_PRESETS["llama2-7b"]
LLAMA70B = MODEL_PRESETS["llama2-70b"]
TWO_NODES = ClusterSpec(gpu="A100-40GB", nodes=2, gpus_per_node=8)


@pytest.mark.parametrize(
    "config,model,problem",
    [
        (ParallelConfig(3, 1), LLAMA7B, "heads"),  # 3 does not divide 32 heads
        (ParallelConfig(16, 1), LLAMA70B, "heads"),  # divides 64 heads, not 8 KV heads
        (ParallelConfig(1, 3), LLAMA7B, "layers"),  # 3 does not divide 32 layers
        (ParallelConfig(16, 1), LLAMA7B, "per node"),  # a TP group never spans two nodes
        (ParallelConfig(8, 4), LLAMA7B, "needs 32 GPUs"),
    ],
)
def test_invalid_configs_name_their_problem(config, model, problem):
    problems = config_problems(config, model, TWO_NODES)
    assert problems and any(problem in p for p in problems)


@pytest.mark.parametrize(
    "config", [ParallelConfig(1, 1), ParallelConfig(8, 1), ParallelConfig(2, 8), ParallelConfig(8, 2)]
)
def test_valid_configs_have_no_problem(config):
    assert config_problems(config, LLAMA7B, TWO_NODES) == []


def test_enumerate_matches_lobra_7b_pool():
    """LobRA's 7B pool on 16 GPUs: TP in 1..8, PP dividing 32 layers, at most 16 GPUs."""
    configs = enumerate_configs(LLAMA7B, TWO_NODES)
    assert configs == sorted(configs)
    assert all(not config_problems(c, LLAMA7B, TWO_NODES) for c in configs)
    assert {c.tp for c in configs} == {1, 2, 4, 8}
    assert ParallelConfig(1, 16) in configs and ParallelConfig(2, 8) in configs and ParallelConfig(8, 2) in configs
    assert ParallelConfig(4, 8) not in configs  # 32 GPUs
    assert len(enumerate_configs(LLAMA7B, TWO_NODES, max_gpus=8)) < len(configs)


@pytest.mark.parametrize("text", ["tp2_pp4", "<2,4>", "2x4", "2,4", " TP2_PP4 "])
def test_parse_round_trips(text):
    config = ParallelConfig.parse(text)
    assert config == ParallelConfig(2, 4)
    assert ParallelConfig.parse(config.name) == ParallelConfig.parse(str(config)) == config


@pytest.mark.parametrize("text", ["tp2_pp4_rc", "<2,4,rc>", "2x4rc", "2,4,rc"])
def test_recompute_configs_parse_and_name_apart(text):
    config = ParallelConfig.parse(text)
    assert config == ParallelConfig(2, 4, recompute=True) == ParallelConfig(2, 4).with_recompute()
    assert (config.name, str(config)) == ("tp2_pp4_rc", "<2,4,rc>")
    assert ParallelConfig.parse(config.name) == ParallelConfig.parse(str(config)) == config
    assert config != ParallelConfig(2, 4) and config.n_gpus == 8


@pytest.mark.parametrize("text", ["", "two", "1,2,3", "0x1", "rc"])
def test_parse_rejects_garbage(text):
    with pytest.raises(ValueError):
        ParallelConfig.parse(text)
