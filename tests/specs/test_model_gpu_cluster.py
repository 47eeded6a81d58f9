import json

import pytest

from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.gpus import GPU_PRESETS, resolve_gpu
from lorafleet.specs.model import MODEL_PRESETS, model_from_hf_config, resolve_model

# Published parameter counts (billions); ours omit biases (Qwen) so allow 2%.
PUBLISHED_PARAMS_B = {
    "llama2-7b": 6.74,
    "llama2-13b": 13.0,
    "llama2-70b": 69.0,
    "mistral-7b": 7.24,
    "qwen2.5-72b": 72.7,
    "qwen3-0.6b": 0.6,
    "qwen3-8b": 8.2,
    "gemma2-2b": 2.61,
    "gemma2-9b": 9.24,
    "gemma3-1b": 1.0,
    "phi3-mini": 3.82,
    "phi4": 14.7,
    "smollm2-135m": 0.135,
}


@pytest.mark.parametrize("name,billions", sorted(PUBLISHED_PARAMS_B.items()))
def test_model_presets_match_published_sizes(name, billions):
    assert MODEL_PRESETS[name].n_params / 1e9 == pytest.approx(billions, rel=0.02)


def test_every_required_preset_exists():
    for name in (
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "lobra-60l",
        "qwen2.5-7b",
        "qwen2.5-32b",
        "qwen2.5-72b",
        "mistral-7b",
        "tiny-llama",
    ):
        assert name in MODEL_PRESETS
    for gpu in ("A100-40GB", "A100-80GB", "A800-80GB", "H100-80GB", "H200-141GB", "A6000-48GB", "L40S", "cpu"):
        assert gpu in GPU_PRESETS


@pytest.mark.parametrize(
    "preset,config",
    [
        ("smollm2-135m", {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576}),
        # Gemma's head width (256) is not hidden / heads.
        ("gemma2-9b", {"model_type": "gemma2", "num_hidden_layers": 42, "hidden_size": 3584, "head_dim": 256}),
    ],
)
def test_hf_config_round_trip(tmp_path, preset, config):
    want = MODEL_PRESETS[preset]
    config = {
        **config,
        "sliding_window": want.sliding_window or None,  # Gemma 2's alternates: no layer_types, transformers' rule
        "intermediate_size": want.ffn,
        "num_attention_heads": want.n_heads,
        "num_key_value_heads": want.n_kv_heads,
        "vocab_size": want.vocab,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = model_from_hf_config(tmp_path)
    assert spec.model_dump(exclude={"name"}) == want.model_dump(exclude={"name"})
    assert resolve_model(str(tmp_path)).n_kv_heads == want.n_kv_heads


def test_hf_config_errors_name_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(InputError, match="num_hidden_layers: missing"):
        model_from_hf_config(tmp_path)
    with pytest.raises(InputError, match="unknown model 'gpt-9'"):
        resolve_model("gpt-9", "w.yaml", "model")


def test_gqa_shapes():
    shapes = MODEL_PRESETS["llama2-70b"].target_shapes()
    assert shapes["q_proj"] == (8192, 8192)
    assert shapes["k_proj"] == (8192, 1024)
    assert shapes["down_proj"] == (28672, 8192)


def test_cluster_and_gpu_lookup():
    cluster = ClusterSpec.with_gpus(16, "a100-40gb")
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu) == (2, 8, "A100-40GB")
    assert ClusterSpec.with_gpus(4).gpus_per_node == 4
    assert resolve_gpu("h200-141gb").memory_gib == 141
    with pytest.raises(InputError, match="unknown GPU"):
        resolve_gpu("TPU")
    with pytest.raises(ValueError):
        ClusterSpec.with_gpus(12)
