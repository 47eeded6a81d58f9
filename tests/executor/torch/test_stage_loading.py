"""Per-stage loading (``base_model.load_base`` + ``build_replica(weights=...)``) == the whole-model path.

Two tiny checkpoints are saved with ``save_pretrained(safe_serialization=True)``: tiny-llama
in one fp32 ``model.safetensors``, and a Qwen2 with q/k/v biases and tied embeddings in bf16,
sharded (``max_shard_size``), so the index, the bf16 -> fp32 cast and a tied pair stored once
are all exercised. One forked world of 4 gloo processes builds, on every rank, each
checkpoint's stage both ways for a TP2 + PP2 plan and a TP2xPP2 plan. Every rank checks that
its two stages hold the same parameters and buffers (names, dtypes, shapes, bits), that a
forward of the stage gives the same output, and that the per-stage build read from the
checkpoint exactly its own stage's slices, byte for byte. Over a quantized base (tiny-llama, NF4 on a PP plan, int8
on TP2xPP2: a row-parallel int8 shard keeps its whole row's scale), the stage reads and quantizes only its own
layers, and holds the whole-model path's quantized bytes.
"""

from __future__ import annotations

import json
import pickle
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from lorafleet.data.model_source import ModelSource, SourceKind
from lorafleet.data.weights_index import SAFETENSORS_FILE, SAFETENSORS_INDEX, check_weights
from lorafleet.errors import InputError
from lorafleet.executor.torch.base_model import load_base, load_causal_lm
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers
from lorafleet.executor.torch.quantized_base import QuantizedLinear, quantize_base
from lorafleet.executor.torch.quantized_stage import load_quantized_base
from lorafleet.executor.torch.replica import build_replica
from lorafleet.executor.torch.step import build_inputs, stage_forward
from lorafleet.executor.torch.tp import TP_STYLES, _shard_module, base_index, holds_bias
from lorafleet.runtime.layout import layer_of
from lorafleet.specs.lora import Quantization
from tests.helpers import fleet_harness as h

PLANS = {
    "tp2+pp2": h.plan_of((2, 1), (1, 2)),
    "tp2xpp2": h.plan_of((2, 2)),
    "pp2+tp1+tp1": h.plan_of((1, 2), (1, 1), (1, 1)),
}
#: Quantized cases, on tiny-llama: plan -> the quantization (NF4's blocks of 64 do not split its 64-wide o_proj
#: over two TP ranks, so NF4 runs a plan without TP).
QUANTIZED = {"pp2+tp1+tp1": Quantization.NF4, "tp2xpp2": Quantization.INT8}
UNQUANTIZED = ["tp2+pp2", "tp2xpp2"]
#: "code" (q, v and down: a row-parallel layer) as DoRA: its magnitudes are drawn over the skeleton as NaN and set
#: from the loaded, TP-sliced weights (``MultiLoraLinear.init_magnitudes``, an all-reduce over a row-parallel layer);
#: "summary-b" as VeRA (#41): its shared projections are drawn on the host beside the skeleton and sliced by TP.
KINDS = {"code": {"use_dora": True}, "summary-b": {"use_vera": True}}
ADAPTERS = [t.lora.model_copy(update=KINDS.get(t.name, {})) for t in h.TASKS]
#: The newer families, on the TP2 + PP2 plan: Phi-3's fused projections are read part by part (a TP rank's slice of
#: each of q, k and v), Gemma 3's embedding scale and its two rotary tables are recomputed, not read.
FAMILY_CASES = {"phi3": "tp2+pp2", "gemma3": "tp2+pp2"}
CPU = torch.device("cpu")


def adapters_of(model: str) -> list:
    """The adapters a checkpoint's stages are built with: :data:`ADAPTERS`, as its family names the targets."""
    if model not in FAMILY_CASES:
        return ADAPTERS
    return [t.lora.model_copy(update=KINDS.get(t.name, {})) for t in h.model_tasks(model)]


def save_llama(directory: Path) -> Path:
    """tiny-llama (untied) in one fp32 ``model.safetensors``."""
    h.build_model("llama").save_pretrained(directory, safe_serialization=True)
    return directory


def save_qwen2_tied_sharded(directory: Path) -> Path:
    """A Qwen2 (q/k/v biases) with tied embeddings, in bf16, in shards of at most 40 kB."""
    config = Qwen2Config(
        vocab_size=h.VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="40kB")
    return directory


def save_family(directory: Path) -> Path:
    """A newer family's tiny model (``fleet_harness.FAMILIES``, the directory's name) in one fp32 file."""
    h.build_model(directory.name).save_pretrained(directory, safe_serialization=True)
    return directory


def hf_source(directory: Path) -> ModelSource:
    return ModelSource(kind=SourceKind.HF_DIR, name=str(directory), path=str(directory))


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too) by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _forward(replica, batch_inputs) -> torch.Tensor:
    """The stage's output on a fixed micro-batch (a seeded activation in, off the first stage)."""
    role = replica.role
    x = None
    if not role.is_first_stage:
        gen = torch.Generator().manual_seed(3)
        x = torch.randn((*batch_inputs.input_ids.shape, replica.model.config.hidden_size), generator=gen)
    with torch.no_grad():
        for _, layer in multi_lora_layers(replica.model):  # adapters that act: B != 0, the same in both
            for b in layer.lora_B.values():
                b.fill_(0.01)
            for m in layer.lora_magnitude_vector.values():  # compared apart (magnitude_gap), to rounding
                m.fill_(1.0)
        return stage_forward(replica.model, role, x, batch_inputs)


def _stage_bytes(stage: nn.Module, checkpoint_itemsize: int) -> int:
    """Bytes of the stage's frozen tensors as the checkpoint stores them (a tied pair once)."""
    adapters = {
        id(p) for _, layer in multi_lora_layers(stage) for a in layer.adapters for p in layer.factors(a).values()
    }
    frozen = [t for t in [*stage.parameters(), *stage.buffers()] if id(t) not in adapters]
    persistent = {id(t) for t in stage.state_dict(keep_vars=True).values()}
    return sum(t.numel() * checkpoint_itemsize for t in frozen if id(t) in persistent)


def compare_stages(
    directory: Path, plan_name: str, rank: int, world: int, itemsize: int, quantize: Quantization | None = None
) -> dict:
    """Builds ``rank``'s stage of ``directory``'s model under a plan both ways (over a base quantized as
    ``quantize``); what differs."""
    plan = PLANS[plan_name]
    adapters = adapters_of(directory.name)
    seeds = range(len(adapters))
    model = load_causal_lm(hf_source(directory))
    if quantize is not None:
        quantize_base(model, quantize)
    whole = build_replica(model, adapters, plan, rank, world, seeds=seeds, device=CPU)
    if quantize is None:
        skeleton, weights = load_base(hf_source(directory))
    else:
        skeleton, weights = load_quantized_base(hf_source(directory), torch.float32, quantize)
    staged = build_replica(skeleton, adapters, plan, rank, world, seeds=seeds, device=CPU, weights=weights)
    a, b = _tensors(whole.model), _tensors(staged.model)
    role = staged.role
    magnitudes = [n for n in a if "lora_magnitude_vector" in n]
    out = {
        "names": (sorted(a), sorted(b)),
        "differ": [
            n
            for n in a
            if n in b
            and n not in magnitudes
            and not (a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and torch.equal(a[n], b[n]))
        ],
        # The whole path's ||W||_c of each row, the staged one's from the TP slices' squares summed: equal to rounding.
        "magnitudes": len(magnitudes),
        "magnitude_gap": max((float(((a[n] - b[n]) / a[n]).abs().max()) for n in magnitudes), default=0.0),
        "meta": [n for n, t in b.items() if t.is_meta],
        "tied": [
            m.lm_head is not None
            and m.model.embed_tokens is not None
            and m.lm_head.weight is m.model.embed_tokens.weight
            for m in (whole.model, staged.model)
        ],
        "reads": weights.reads,
        "whole_shapes": {entry.key: entry.shape for entry in weights.entries.values()},
        "quantized": sum(isinstance(m, QuantizedLinear) for m in staged.model.modules()),
        "stage_bytes": _stage_bytes(staged.model, itemsize),
        "layers": list(role.layers),
        "first": role.is_first_stage,
        "last": role.is_last_stage,
    }
    streams = h.synthetic_streams()
    batch = streams.global_batch(0)
    mb = h.make_step_plan(batch, len(plan.replicas)).work[role.replica.replica_id].microbatches[0]
    examples = streams.examples(batch.task_ids, batch.sample_ids)
    inputs = build_inputs(mb, [examples[q] for q in mb.seq_ids], [1.0] * len(h.TASKS), CPU)
    # Equal to rounding, not bitwise: a GEMM may round by where its operands lie in memory (the whole path's weights
    # are slices of whole tensors, the stage's its own), 1 ulp on the first stage on an AMD EPYC's CPU BLAS.
    reference, forward = _forward(whole, inputs), _forward(staged, inputs)
    out["forward_close"] = torch.allclose(forward, reference, rtol=1e-5, atol=1e-6)  # a NaN is not close
    return out


def _rank_main(rank: int, world: int, tmp: str, cases: list[tuple[str, str, int, Quantization | None]]) -> None:
    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        results = {(d, p, q): compare_stages(Path(d), p, rank, world, size, q) for d, p, size, q in cases}
        Path(tmp, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llama": save_llama(root / "llama"),
        "qwen2": save_qwen2_tied_sharded(root / "qwen2"),
        **{family: save_family(root / family) for family in FAMILY_CASES},
    }


@pytest.fixture(scope="module")
def world(checkpoints, tmp_path_factory):
    """rank -> (checkpoint directory, plan, quantization) -> what ``compare_stages`` found."""
    tmp = tmp_path_factory.mktemp("world")
    itemsize = {"llama": 4, "qwen2": 2}
    cases = [(str(checkpoints[name]), p, itemsize[name], None) for name in itemsize for p in UNQUANTIZED]
    cases += [(str(checkpoints[name]), p, 4, None) for name, p in FAMILY_CASES.items()]
    cases += [(str(checkpoints["llama"]), p, 4, kind) for p, kind in QUANTIZED.items()]
    mp.start_processes(_rank_main, args=(4, str(tmp), cases), nprocs=4, start_method="fork")
    return {r: pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(4)}


def test_checkpoints_are_what_the_cases_need(checkpoints):
    llama, qwen2 = checkpoints["llama"], checkpoints["qwen2"]
    assert (llama / SAFETENSORS_FILE).is_file() and not (llama / SAFETENSORS_INDEX).exists()
    index = json.loads((qwen2 / SAFETENSORS_INDEX).read_text())["weight_map"]
    assert len(set(index.values())) > 3 and "lm_head.weight" not in index  # sharded; the tied pair stored once
    assert "model.layers.0.self_attn.q_proj.bias" in index


#: (checkpoint, plan) of every unquantized case.
CASES = [(model, plan) for model in ("llama", "qwen2") for plan in UNQUANTIZED] + list(FAMILY_CASES.items())


@pytest.mark.parametrize("model,plan", CASES)
def test_stage_equals_the_whole_model_path(world, checkpoints, model, plan):
    for rank in range(4):
        found = world[rank][(str(checkpoints[model]), plan, None)]
        whole_names, stage_names = found["names"]
        assert whole_names == stage_names, f"rank {rank}"
        assert any("rotary_emb." in n and n.endswith("inv_freq") for n in stage_names)
        assert found["differ"] == [] and found["meta"] == [], f"rank {rank}"
        assert found["magnitude_gap"] <= 1e-6, f"rank {rank}"  # and no NaN left: a NaN fails the comparison
        assert found["forward_close"], f"rank {rank}"
        # The tied pair stays one tensor where the stage holds both ends (pp = 1), as on the whole path.
        assert found["tied"][0] == found["tied"][1]
        if model in ("qwen2", "gemma3") and found["first"] and found["last"]:
            assert found["tied"][1]
    assert sum(world[r][(str(checkpoints[model]), plan, None)]["magnitudes"] for r in range(4)) > 0


@pytest.mark.parametrize("model,plan", CASES)
def test_a_stage_reads_only_its_own_slices(world, checkpoints, model, plan):
    tied = model in ("qwen2", "gemma3")
    for rank in range(4):
        found = world[rank][(str(checkpoints[model]), plan, None)]
        keys = [key for key, _, _ in found["reads"]]
        again = {key for key in keys if keys.count(key) > 1}  # a fused projection's slices: one read per part
        assert all(key.split(".")[-2] in ("qkv_proj", "gate_up_proj") for key in again), f"rank {rank} read twice"
        for key in keys:
            if ".layers." in key:
                assert layer_of(key) in found["layers"], f"rank {rank} read {key}"
            elif key == "model.embed_tokens.weight":
                assert found["first"] or (tied and found["last"]), f"rank {rank} read {key}"
            else:
                assert found["last"] and key in ("model.norm.weight", "lm_head.weight"), f"rank {rank} read {key}"
        # Exactly the bytes of the stage's tensors (TP slices, not whole projections).
        assert sum(n for _, _, n in found["reads"]) == found["stage_bytes"], f"rank {rank}"


@pytest.mark.parametrize("plan", list(QUANTIZED))
def test_a_stage_over_a_quantized_base_equals_the_whole_model_path(world, checkpoints, plan):
    """A stage loaded per stage over a quantized base holds the whole path's quantized bytes (and scales), DoRA
    magnitudes to rounding and the same forward; it read only its own layers, each projection whole (quantized, then
    TP-cut), the rest as its TP slices."""
    key = (str(checkpoints["llama"]), plan, QUANTIZED[plan])
    projections = 0
    for rank in range(4):
        found = world[rank][key]
        whole_names, stage_names = found["names"]
        assert whole_names == stage_names and found["differ"] == [] and found["meta"] == [], f"rank {rank}"
        assert found["magnitude_gap"] <= 1e-6 and found["forward_close"], f"rank {rank}"
        assert found["quantized"] == 7 * len(found["layers"]), f"rank {rank}"
        projections += found["quantized"]
        for name, shape, _ in found["reads"]:
            if ".layers." in name:
                assert layer_of(name) in found["layers"], f"rank {rank} read {name}"
                if name.rpartition(".")[0].rpartition(".")[2] in TP_STYLES:
                    assert shape == found["whole_shapes"][name], f"rank {rank} read part of {name}"
    assert projections > 0


def test_tp_slices_come_from_the_same_rule_as_sharding():
    """``base_index`` on the whole tensor == what ``parallelize_tensor`` keeps, bias rule included."""
    gen = torch.Generator().manual_seed(0)
    for suffix, style in TP_STYLES.items():
        linear = nn.Linear(8, 12, bias=True)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(12, 8, generator=gen))
            linear.bias.copy_(torch.randn(12, generator=gen))
        name = f"model.layers.0.x.{suffix}"
        for tp in (2, 4):
            for r in range(tp):
                part = _shard_module(linear, style, r, tp)
                (weight,) = base_index(name, "weight", (12, 8), r, tp)
                assert torch.equal(part.weight, linear.weight[weight])
                assert (part.bias is not None) == holds_bias(style, r)
                if part.bias is not None:
                    (bias,) = base_index(name, "bias", (12,), r, tp)
                    assert torch.equal(part.bias, linear.bias[bias])
    assert base_index("model.embed_tokens", "weight", (16, 8), 1, 2) == [(slice(None), slice(None))]


def test_skeleton_gets_the_host_models_adapters(checkpoints):
    """Injection into the meta skeleton draws the same adapters, on the host, as into the real model."""
    real = load_causal_lm(hf_source(checkpoints["llama"]))
    skeleton, _ = load_base(hf_source(checkpoints["llama"]))
    for model in (real, skeleton):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            inject_multi_lora(model, ADAPTERS)
    a, b = dict(multi_lora_layers(real)), dict(multi_lora_layers(skeleton))
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].base_layer.weight.is_meta
        for factor in ("lora_A", "lora_B"):
            for key, p in getattr(a[name], factor).items():
                q = getattr(b[name], factor)[key]
                assert q.device == CPU and q.requires_grad and torch.equal(p, q)


def test_sources_without_safetensors_are_built_whole():
    model, weights = load_base(h.TINY)
    assert weights is None and not any(p.is_meta for p in model.parameters())


# ---- errors: an InputError naming the file and tensor, before anything is built ------------------


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_tensor(checkpoints, tmp_path):
    d = _copy_checkpoint(checkpoints["llama"], tmp_path / "m")
    tensors = load_file(d / SAFETENSORS_FILE)
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, d / SAFETENSORS_FILE, metadata={"format": "pt"})
    with pytest.raises(InputError) as err:
        load_base(hf_source(d))
    assert err.value.path == str(d / SAFETENSORS_FILE) and err.value.field == "model.layers.2.mlp.down_proj.weight"
    assert "missing" in err.value.msg


def test_shape_mismatch(checkpoints, tmp_path):
    d = _copy_checkpoint(checkpoints["llama"], tmp_path / "s")
    tensors = load_file(d / SAFETENSORS_FILE)
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, d / SAFETENSORS_FILE, metadata={"format": "pt"})
    with pytest.raises(InputError) as err:
        load_base(hf_source(d))
    assert err.value.path == str(d / SAFETENSORS_FILE) and err.value.field == "model.norm.weight"
    assert "(32,)" in err.value.msg and "(64,)" in err.value.msg


def test_sharded_checkpoint_errors(checkpoints, tmp_path):
    d = _copy_checkpoint(checkpoints["qwen2"], tmp_path / "q")
    index = json.loads((d / SAFETENSORS_INDEX).read_text())
    # A tensor the index does not list: named with the index.
    missing = json.loads(json.dumps(index))
    del missing["weight_map"]["model.layers.3.self_attn.k_proj.bias"]
    (d / SAFETENSORS_INDEX).write_text(json.dumps(missing))
    with pytest.raises(InputError) as err:
        load_base(hf_source(d))
    assert err.value.path == str(d / SAFETENSORS_INDEX) and err.value.field == "model.layers.3.self_attn.k_proj.bias"
    # A shard the index names but the directory lacks.
    (d / SAFETENSORS_INDEX).write_text(json.dumps(index))
    shard = index["weight_map"]["model.norm.weight"]
    (d / shard).unlink()
    with pytest.raises(InputError, match=shard) as err:
        load_base(hf_source(d))
    assert err.value.path == str(d / SAFETENSORS_INDEX)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_a_truncated_weights_file_is_named(checkpoints, tmp_path, model):
    """A safetensors file cut short (a copy that did not finish) or emptied is one InputError naming it, from
    the header alone, in a worker (``load_base``) and in the launcher's check (``check_weights``): not
    safetensors' own SafetensorError."""
    d = _copy_checkpoint(checkpoints[model], tmp_path / "t")
    victim = sorted(d.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    for check in (lambda: load_base(hf_source(d)), lambda: check_weights(d)):
        with pytest.raises(InputError, match="not a readable safetensors file") as err:
            check()
        assert err.value.path == str(victim)
    victim.write_bytes(b"")
    with pytest.raises(InputError, match="header too small"):
        check_weights(d)
