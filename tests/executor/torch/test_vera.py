"""VeRA in the multi-adapter operator: PEFT 0.21's ``VeraConfig`` model task by task in a micro-batch mixed with LoRA
and DoRA tenants, dropout included, split over TP2 equal to the unsplit model, exported as PEFT writes it, and refused
where it cannot run. Joint training equal to each task alone with PEFT, on TP and PP replicas and across a resume,
rides on ``test_dora.py``'s fleet, whose fourth task is VeRA."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.vera.layer import Linear as PeftVera
from safetensors.torch import load_file
from torch import nn

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.errors import InputError
from lorafleet.executor.torch.checkpoint import TaskState, TrainState, check_adapter_kinds
from lorafleet.executor.torch.dropout import draw_keep_mask
from lorafleet.executor.torch.grad_sync import adapter_params
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers, projection_shapes, segments_context
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.peft_export import (
    CONFIG_NAME,
    SAFETENSORS_WEIGHTS_NAME,
    load_peft_adapter,
    lora_config,
    read_peft_spec,
    save_peft_adapter,
)
from lorafleet.executor.torch.routing import Segments
from lorafleet.executor.torch.vera import LAMBDA_B, LAMBDA_D, VeraProjections, draw_projections
from lorafleet.runtime.layout import ModelDims
from lorafleet.specs.lora import LoraSpec
from lorafleet.specs.model import ModelSpec
from tests.executor.torch.conftest import build_tiny_model
from tests.helpers import fleet_harness as h
from tests.helpers.trained_alone import peft_model_of

SPECS = [
    LoraSpec(rank=8, use_vera=True, vera_prng_key=3),
    LoraSpec(rank=2, alpha=4),
    LoraSpec(rank=4, alpha=8, use_dora=True, target_modules=("q_proj", "down_proj")),
    LoraSpec(rank=6, use_vera=True, vera_d_initial=0.5, target_modules=("v_proj", "down_proj")),
]
VERA_TASKS = (0, 3)


def _moved(model: nn.Module, seed: int = 5) -> nn.Module:
    """Every ``B`` and ``λ_b`` off zero (at their start every adapter is the identity update and tests vacuous)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in multi_lora_layers(model):
            for a in layer.adapters:
                for factor, param in layer.factors(a).items():
                    if factor in ("lora_B", LAMBDA_B):
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def _injected(base: nn.Module, specs: list[LoraSpec] = SPECS) -> nn.Module:
    model = copy.deepcopy(base)
    inject_multi_lora(model, specs, seeds=list(range(1, len(specs) + 1)))
    return model


def _grads(model: nn.Module, task: int) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{f}": p.grad for name, layer in multi_lora_layers(model) if task in layer.adapters
        for f, p in layer.factors(task).items()
    }  # fmt: skip


def test_projections_and_vectors_start_as_pefts():
    """A and B are PEFT's draw from ``projection_prng_key`` over the model's widest targeted in and out (one pair the
    layers share), λ_d = d_initial and λ_b = 0: the same tensors as ``get_peft_model`` makes."""
    base = build_tiny_model("qwen2")
    model = _injected(base)
    for task in VERA_TASKS:
        reference = peft.get_peft_model(copy.deepcopy(base), lora_config(SPECS[task]))
        shared = {
            id(layer.vera_projections[str(task)]) for _, layer in multi_lora_layers(model) if task in layer.adapters
        }
        assert len(shared) == 1
        projections = next(layer.vera_projections[str(task)] for _, layer in multi_lora_layers(model)
                           if task in layer.adapters)  # fmt: skip
        assert torch.equal(projections.vera_A, reference.base_model.vera_A["default"])
        assert torch.equal(projections.vera_B, reference.base_model.vera_B["default"])
        theirs = dict(reference.named_parameters())
        for name, layer in multi_lora_layers(model):
            if task in layer.adapters:
                for factor, param in layer.factors(task).items():
                    assert torch.equal(param, theirs[f"base_model.model.{name}.{factor}.default"]), (name, factor)


def test_mixed_microbatch_matches_peft_task_by_task():
    """One micro-batch of two VeRA tenants, a LoRA and a DoRA one: each VeRA task's logits and every vector's
    gradient equal PEFT's VeraConfig model's on that task's rows alone."""
    base = build_tiny_model("qwen2")
    model = _moved(_injected(base))
    ids = torch.randint(0, 1024, (4, 7), generator=torch.Generator().manual_seed(3))
    with segments_context(model, Segments.padded([0, 1, 2, 3], [7, 7, 7, 7], 7)):
        logits = model(ids).logits
    logits.square().sum().backward()
    for task in VERA_TASKS:
        reference = peft_model_of(base, model, task, SPECS)
        theirs = reference(ids[task : task + 1]).logits
        assert (theirs - base(ids[task : task + 1]).logits).abs().max() > 1e-3  # sanity: the adapter moves them
        torch.testing.assert_close(logits[task : task + 1], theirs, rtol=1e-5, atol=1e-5)
        theirs.square().sum().backward()
        want = {k.removeprefix("base_model.model.").removesuffix(".default"): p.grad
                for k, p in reference.named_parameters() if p.requires_grad}  # fmt: skip
        got = _grads(model, task)
        assert set(got) == set(want) and len(got) == 2 * 2 * len(SPECS[task].target_modules)
        for key, grad in got.items():
            assert (grad - want[key]).abs().max() <= 1e-5 * want[key].abs().max(), key


def _tp2_against_unsplit(_run: None) -> dict[str, float]:
    """Each rank of a TP2 group: a tiny phi3 (fused qkv_proj and gate_up_proj column-parallel part by part, o_proj
    and down_proj row-parallel), VeRA, LoRA and DoRA tenants mixed, split by ``parallelize_tensor``; one forward and
    backward against the unsplit model (unfused column-parallel layers: ``test_dora.py``'s TP2 fleet). The
    replicated factors' partial gradients are summed over the group, as the gradient sync sums them over their
    holders. Rank 0 returns the largest relative gaps."""
    import torch.distributed as dist

    from lorafleet.executor.torch.fused import output_parts
    from lorafleet.executor.torch.inject import module_suffix
    from lorafleet.executor.torch.tp import TP_STYLES, adapter_shard_dim, parallelize_tensor, shard

    rank, group = dist.get_rank(), dist.new_group([0, 1])
    fused = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    whole = _moved(_injected(h.build_model("phi3"), [s.model_copy(update={"target_modules": fused}) for s in SPECS]))
    part = copy.deepcopy(whole)
    parallelize_tensor(part, rank, 2, group)
    ids = torch.randint(0, 1024, (4, 6), generator=torch.Generator().manual_seed(2))
    outputs = []
    for model in (whole, part):
        with segments_context(model, Segments.padded([0, 1, 2, 3], [6, 6, 6, 6], 6)):
            logits = model(ids).logits
        logits.square().sum().backward()
        outputs.append(logits.detach())
    gaps = {"logits": float((outputs[1] - outputs[0]).abs().max() / outputs[0].abs().max())}
    heads, kv_heads = whole.config.num_attention_heads, whole.config.num_key_value_heads
    for (name, w_layer), (_, p_layer) in zip(multi_lora_layers(whole), multi_lora_layers(part), strict=True):
        style = TP_STYLES[module_suffix(name)]
        parts = output_parts(module_suffix(name), w_layer.out_features, heads, kv_heads)
        for task in (t for t in VERA_TASKS if t in w_layer.adapters):
            for factor, param in p_layer.factors(task).items():
                dim = adapter_shard_dim(style, factor)
                grad = param.grad.clone()
                if dim is None:
                    dist.all_reduce(grad, group=group)
                want = shard(w_layer.factors(task)[factor].grad, dim, rank, 2, parts if dim == 0 else ())
                key = f"{factor} {style.value}"
                gaps[key] = max(gaps.get(key, 0.0), float((grad - want).abs().max() / want.abs().max()))
    every: list = [None, None]
    dist.all_gather_object(every, gaps)
    return {key: max(g[key] for g in every) for key in gaps}


def test_tp2_column_and_row_parallel_equal_the_unsplit_model(tmp_path):
    """On a TP2 replica a VeRA tenant's λ_b is split with B's rows on column-parallel layers (a fused one part by
    part), λ_d is replicated with a partial gradient, and on row-parallel layers both vectors are replicated with
    partial gradients: once summed over the group, every gradient and the logits equal the unsplit model's
    (relative 1e-5), on Phi-3's fused projections too."""
    (gaps,) = h.run_world(2, [None], tmp_path, body=_tp2_against_unsplit)
    assert set(gaps) == {"logits", *(f"{f} {style}" for f in (LAMBDA_D, LAMBDA_B) for style in ("column", "row"))}
    assert all(gap <= 1e-5 for gap in gaps.values()), gaps


def test_gradient_sync_pieces_of_a_vera_adapter():
    """The gradient sum and checkpoints list a VeRA task's vectors alone, λ_b split like B on column-parallel
    layers, λ_d never."""
    base = build_tiny_model("qwen2")
    params = adapter_params(projection_shapes(base), SPECS[3:], ModelDims.of(base.config))
    got = {(p.module.rpartition(".")[2], p.factor): (p.shape, p.shard_dim) for p in params}
    assert got == {
        ("v_proj", LAMBDA_D): ((6,), None),
        ("v_proj", LAMBDA_B): ((32,), 0),
        ("down_proj", LAMBDA_D): ((6,), None),
        ("down_proj", LAMBDA_B): ((64,), None),
    }


def test_export_loads_in_peft_with_pefts_keys_and_gives_the_executors_logits(tmp_path):
    """The exported directory is PEFT's VeRA format (peft_type VERA, save_projection, the projections once): its keys
    are exactly those PEFT saves for the config, ``PeftModel.from_pretrained`` gives the executor's logits, and it
    loads back into a task slot of a fresh fleet."""
    base = build_tiny_model("qwen2")
    model = _moved(_injected(base))
    ids = torch.randint(0, 1024, (1, 7), generator=torch.Generator().manual_seed(4))
    task = 3
    path = save_peft_adapter(model, task, tmp_path / "vera")
    config = json.loads((path / CONFIG_NAME).read_text())
    assert (config["peft_type"], config["save_projection"], config["r"]) == ("VERA", True, 6)
    own = peft.get_peft_model(copy.deepcopy(base), lora_config(SPECS[task]))
    own.save_pretrained(tmp_path / "peft")
    assert set(load_file(path / SAFETENSORS_WEIGHTS_NAME)) == set(
        load_file(tmp_path / "peft" / SAFETENSORS_WEIGHTS_NAME)
    )
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), path)
    with segments_context(model, Segments.padded([task], [7], 7)):
        want = model(ids).logits
    torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert read_peft_spec(path) == SPECS[task].model_copy(update={"target_modules": ("down_proj", "v_proj")})
    fresh = _injected(base, SPECS[:2])
    load_peft_adapter(fresh, path, 1)
    with segments_context(fresh, Segments.padded([1], [7], 7)):
        torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("other", [{"use_dora": True}, {"use_rslora": True}, {"lr_ratio": 4.0}])
def test_vera_with_what_it_cannot_combine_is_refused(other):
    with pytest.raises(ValueError, match=f"use_vera cannot be combined with {next(iter(other))}"):
        LoraSpec(use_vera=True, **other)


def test_a_vera_file_without_its_projections_and_a_kind_change_on_resume_are_input_errors(tmp_path):
    base = build_tiny_model("qwen2")
    model = _injected(base)
    path = save_peft_adapter(model, 0, tmp_path / "vera")
    config = json.loads((path / CONFIG_NAME).read_text())
    (path / CONFIG_NAME).write_text(json.dumps({**config, "save_projection": False}))
    with pytest.raises(InputError, match="save_projection: False is not supported"):
        read_peft_spec(path)
    vera, lora = SPECS[0], SPECS[1]
    state = TrainState(1, (TaskState("t", vera, {}, {}, 1),), {})
    check_adapter_kinds(tmp_path, state, [vera])
    with pytest.raises(InputError, match="lora.use_vera: the checkpoint's adapter is VeRA, the run's is LoRA"):
        check_adapter_kinds(tmp_path, state, [lora])


def test_a_vera_adapter_trains_vectors_only_and_costs_loras_gemms():
    """Trainable parameters a block: Σ (r + out) over the targets; the GEMMs a token meets: LoRA's r (in + out)."""
    model = ModelSpec(name="m", n_layers=2, hidden=64, ffn=176, n_heads=4, n_kv_heads=2, vocab=1024)
    vera = AdapterLoad.from_specs([SPECS[3]])
    lora = AdapterLoad.from_specs([LoraSpec(rank=6, alpha=6, target_modules=("v_proj", "down_proj"))])
    assert vera.params_per_layer(model) == (6 + 32) + (6 + 64)
    assert vera.mean_params_per_layer(model) == lora.mean_params_per_layer(model) == 6 * (64 + 32) + 6 * (176 + 64)


def test_a_layer_refuses_projections_too_small_for_it():
    small = VeraProjections(torch.zeros(4, 8), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="cannot serve a"):
        MultiLoraLinear(nn.Linear(16, 8)).add_adapter(0, LoraSpec(rank=4, use_vera=True), projections=small)


class _Mask(nn.Module):
    """PEFT's VeRA dropout replaced by the operator's own keep-mask, so both drop the same elements."""

    def __init__(self, keep: torch.Tensor, p: float) -> None:
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x):
        return x * self.keep / (1 - self.p)


def test_vera_with_dropout_matches_peft_on_the_same_mask():
    """A VeRA tenant with dropout beside a dropping LoRA one, its segments split: output, input gradient and both
    vectors' gradients equal PEFT's ``vera.Linear`` driven by the operator's keep-mask."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 16)
    spec = LoraSpec(rank=4, dropout=0.3, use_vera=True)
    projections = VeraProjections(*draw_projections(4, 0, 32, 20))  # wider than the layer: it slices them
    layer = MultiLoraLinear(copy.deepcopy(linear)).train()
    layer.add_adapter(0, spec, (torch.randn(4), torch.randn(16) * 0.3), projections=projections)
    layer.add_adapter(1, LoraSpec(rank=2, alpha=2, dropout=0.5), (torch.randn(2, 24), torch.randn(16, 2)))
    layer.segments = Segments.packed([0, 1, 0], [5, 4, 3])
    x = torch.randn(12, 24, requires_grad=True)
    torch.manual_seed(9)
    keep = draw_keep_mask(12, 24, layer.routing(), device="cpu")
    torch.manual_seed(9)  # the layer draws the same mask
    y = layer(x)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    rows = [*range(5), *range(9, 12)]
    assert not keep[rows].all()
    A, B = BufferDict({"default": projections.vera_A}), BufferDict({"default": projections.vera_B})
    reference = PeftVera(copy.deepcopy(linear), A, B, "default", config=lora_config(spec), r=4).train()
    with torch.no_grad():
        for factor, param in layer.factors(0).items():
            getattr(reference, factor)["default"].copy_(param)
    reference.vera_dropout["default"] = _Mask(keep[rows], spec.dropout)
    x_ref = x.detach()[rows].clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(grad_y[rows])
    torch.testing.assert_close(y[rows], y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad[rows], x_ref.grad, rtol=1e-5, atol=1e-5)
    for factor, param in layer.factors(0).items():
        torch.testing.assert_close(param.grad, getattr(reference, factor)["default"].grad, rtol=1e-5, atol=1e-5)


def test_a_relabel_keeps_a_vera_adapters_projections_and_vectors_under_its_new_id():
    """A task leaving a running fleet (``MultiLoraLinear.relabel``): the VeRA adapter that stays is renumbered with its
    frozen pair and its vectors, the same objects (an optimizer's state keyed by them carries over); the one that
    leaves takes its pair with it."""
    layer = MultiLoraLinear(nn.Linear(24, 16))
    projections = VeraProjections(*draw_projections(4, 0, 24, 16))
    layer.add_adapter(0, LoraSpec(rank=2, alpha=2), (torch.randn(2, 24), torch.randn(16, 2)))
    layer.add_adapter(1, LoraSpec(rank=4, use_vera=True), (torch.randn(4), torch.randn(16)), projections=projections)
    vectors = layer.factors(1)
    layer.relabel({1: 0})
    assert list(layer.adapters) == [0] and layer.adapters[0].use_vera
    assert dict(layer.vera_projections.items()) == {"0": projections}
    assert all(layer.factors(0)[name] is param for name, param in vectors.items())
    assert not len(layer.lora_A) and not len(layer.lora_B)
