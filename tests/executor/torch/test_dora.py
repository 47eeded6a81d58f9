"""DoRA in the multi-adapter operator: PEFT's ``use_dora=True`` layer by layer, in a mixed micro-batch, with
dropout, exported as PEFT writes it, and trained jointly on TP and PP replicas equal to each task alone."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import peft
import pytest
import torch
from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file, save_file
from torch import nn

from lorafleet.errors import InputError
from lorafleet.executor.torch.checkpoint import check_adapter_kinds, latest_step_dir, load_train_state
from lorafleet.executor.torch.dora import MAGNITUDE, spans, weight_norms
from lorafleet.executor.torch.dropout import draw_keep_mask
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers, segments_context
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.peft_export import load_peft_adapter, lora_config, save_peft_adapter
from lorafleet.executor.torch.routing import Segments
from lorafleet.specs.lora import LoraSpec
from tests.helpers import fleet_harness as h
from tests.helpers.trained_alone import ATOL, STEPS, _max_diff, peft_model_of, train_alone

SPECS = [
    LoraSpec(rank=4, alpha=8, use_dora=True),
    LoraSpec(rank=2, alpha=4),
    LoraSpec(rank=8, alpha=16, use_dora=True, use_rslora=True, target_modules=("q_proj", "down_proj")),
]


@pytest.fixture
def trained(tiny_model):
    """(base, injected model whose adapters moved off their start: B random, m ≠ ||W||_c, ids)."""
    base = tiny_model("qwen2")  # biased q/k/v: DoRA rescales Y - b, not Y
    model = copy.deepcopy(base)
    inject_multi_lora(model, SPECS, seeds=[1, 2, 3])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, layer in multi_lora_layers(model):
            for a in layer.adapters:
                factors = layer.factors(a)
                factors["lora_B"].copy_(torch.randn(factors["lora_B"].shape, generator=gen) * 0.1)
                if MAGNITUDE in factors:
                    factors[MAGNITUDE].mul_(1 + 0.2 * torch.randn(factors[MAGNITUDE].shape, generator=gen))
    ids = torch.randint(0, 1024, (3, 7), generator=torch.Generator().manual_seed(3))
    return base, model, ids


def test_initial_magnitude_is_pefts():
    """m starts as PEFT initialises it: ||W + s B A||_c with B = 0, i.e. ||W||_c."""
    base = h.build_model()
    model = copy.deepcopy(base)
    inject_multi_lora(model, SPECS[:1], seeds=[1])
    reference = peft.get_peft_model(copy.deepcopy(base), lora_config(SPECS[0]))
    for name, layer in multi_lora_layers(model):
        theirs = reference.get_submodule(f"base_model.model.{name}").lora_magnitude_vector["default"].weight
        torch.testing.assert_close(layer.lora_magnitude_vector["0"], theirs, rtol=1e-6, atol=0)


def test_norms_are_the_column_norms_of_w_plus_delta_and_split_over_inputs():
    """``||W + s B A||_c`` from the expanded form equals the direct one (fp64), and the row-parallel split's rule
    holds: the squares of the input halves' norms add up to the whole's (what the TP all-reduce sums)."""
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(12, 20, generator=gen, dtype=torch.float64)
    A = [torch.randn(r, 20, generator=gen, dtype=torch.float64) for r in (3, 5)]
    B = [torch.randn(12, r, generator=gen, dtype=torch.float64) for r in (3, 5)]
    got = weight_norms(W, A, B, [0.5, 2.0])
    want = torch.stack([torch.linalg.norm(W + s * b @ a, dim=1) for a, b, s in zip(A, B, [0.5, 2.0])])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    halves = [weight_norms(W[:, k], [a[:, k] for a in A], B, [0.5, 2.0]) for k in (slice(0, 8), slice(8, 20))]
    torch.testing.assert_close((halves[0] ** 2 + halves[1] ** 2).sqrt(), want, rtol=1e-12, atol=0)


def test_spans_merge_an_adapters_segments_across_padding_only():
    """A padded micro-batch: adapter 0's two sequences are one span (the padding between them rescaled, unread);
    another adapter's rows between two segments of one DoRA adapter keep them apart; a plain adapter has none."""
    segments = Segments.padded([0, 0, 1, 0, 2], [3, 4, 2, 5, 4], seq_len=6)  # rows 0-2, 6-9, 12-13, 18-22, 24-27
    assert spans(segments, (0, 2)) == ((0, 0, 10), (0, 18, 23), (1, 24, 28))
    assert spans(segments, (1,)) == ((0, 12, 14),)
    assert spans(Segments.packed([0, 1, 0], [2, 0, 3]), (0,)) == ((0, 0, 5),)  # an empty segment is no boundary


def test_mixed_microbatch_matches_peft_task_by_task(trained):
    """One micro-batch of two DoRA tenants and a plain LoRA one: each task's logits and every gradient (A, B and the
    magnitude) equal PEFT's use_dora model's on that task's rows alone."""
    base, model, ids = trained
    with segments_context(model, Segments.padded([0, 1, 2], [7, 7, 7], 7)):
        logits = model(ids).logits
    logits.square().sum().backward()
    for task in range(len(SPECS)):
        reference = peft_model_of(base, model, task, SPECS)
        theirs = reference(ids[task : task + 1]).logits
        # sanity (PEFT's mixed-batch test): the task's adapter moves its logits off the base's
        assert (theirs - base(ids[task : task + 1]).logits).abs().max() > 1e-3
        torch.testing.assert_close(logits[task : task + 1], theirs, rtol=1e-5, atol=1e-5)
        theirs.square().sum().backward()
        params = dict(reference.named_parameters())
        n_factors = 0
        for name, layer in multi_lora_layers(model):
            if task in layer.adapters:
                for factor, param in layer.factors(task).items():
                    want = params[f"base_model.model.{name}.{factor}.default.weight"].grad
                    assert (param.grad - want).abs().max() <= 1e-5 * want.abs().max(), (name, factor)
                    n_factors += 1
        assert n_factors == (3 if SPECS[task].use_dora else 2) * len(SPECS[task].target_modules) * 2


class _Mask(nn.Module):
    """PEFT's dropout replaced by the operator's own keep-mask, so both drop the same elements."""

    def __init__(self, keep: torch.Tensor, p: float) -> None:
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x):
        return x * self.keep.view_as(x) / (1 - self.p)


def test_dora_with_dropout_matches_peft_on_the_same_mask():
    """With dropout PEFT's DoRA is not ``g ⊙ (Y - b) + b``: its ``(g - 1) ⊙ Xd W^T`` term sees the dropped input.
    Output, input gradient and every factor's gradient match PEFT's layer driven by the same mask."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 16)
    layer = MultiLoraLinear(copy.deepcopy(linear)).train()
    specs = [LoraSpec(rank=4, alpha=8, dropout=0.3, use_dora=True), LoraSpec(rank=2, alpha=2, dropout=0.5)]
    for a, spec in enumerate(specs):
        layer.add_adapter(a, spec, (torch.randn(spec.rank, 24) * 0.3, torch.randn(16, spec.rank) * 0.3))
    with torch.no_grad():
        layer.lora_magnitude_vector["0"].mul_(1.5)
    layer.segments = Segments.packed([0, 1, 0], [5, 4, 3])
    x = torch.randn(12, 24, requires_grad=True)
    torch.manual_seed(9)
    keep = draw_keep_mask(12, 24, layer.routing(), device="cpu")
    assert keep is not None and not keep[:5].all()
    torch.manual_seed(9)  # the layer draws the same mask
    y = layer(x)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    for a, rows in ((0, [*range(5), *range(9, 12)]), (1, list(range(5, 9)))):
        spec = specs[a]
        config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, use_dora=spec.use_dora)
        reference = peft.tuners.lora.Linear(
            copy.deepcopy(linear), "default", config, r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
            use_dora=spec.use_dora,
        ).train()  # fmt: skip
        with torch.no_grad():
            for factor, param in layer.factors(a).items():
                getattr(reference, factor)["default"].weight.copy_(param)
        reference.lora_dropout["default"] = _Mask(keep[rows], specs[a].dropout)
        x_ref = x.detach()[rows].clone().requires_grad_()
        y_ref = reference(x_ref)
        y_ref.backward(grad_y[rows])
        torch.testing.assert_close(y[rows], y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad[rows], x_ref.grad, rtol=1e-5, atol=1e-5)
        for factor, param in layer.factors(a).items():
            torch.testing.assert_close(
                param.grad, getattr(reference, factor)["default"].weight.grad, rtol=1e-5, atol=1e-5
            )


#: Two DoRA tenants (one rsLoRA with LoRA+ on q, v and the row-parallel down) and a plain one, each with its own
#: adapter dropout.
DROPOUT_SPECS = [
    LoraSpec(rank=4, alpha=8, dropout=0.1, use_dora=True),
    LoraSpec(
        rank=8, alpha=16, dropout=0.2, use_dora=True, use_rslora=True, lr_ratio=4.0,
        target_modules=("q_proj", "v_proj", "down_proj"),
    ),
    LoraSpec(rank=2, alpha=4, dropout=0.05, target_modules=("o_proj", "up_proj")),
]  # fmt: skip


def _named_factors(model: nn.Module, task: int) -> list[tuple[str, str, nn.Parameter]]:
    """(module, factor, parameter) of every factor of ``task``'s adapter."""
    return [
        (name, factor, param)
        for name, layer in multi_lora_layers(model)
        if task in layer.adapters
        for factor, param in layer.factors(task).items()
    ]


def _factors(model: nn.Module, task: int) -> dict[str, torch.Tensor]:
    """Every factor of ``task``'s adapter by ``<module>.<factor>``, detached."""
    return {f"{name}.{factor}": param.detach() for name, factor, param in _named_factors(model, task)}


def test_joint_training_with_dropout_equals_each_task_alone_with_peft_on_the_same_masks(tiny_model, monkeypatch):
    """Joint DoRA training with adapter dropout through a whole model (qwen2: biased q/k/v) for two steps, every
    micro-batch mixing the three tenants: each task's adapter equals PEFT's ``use_dora`` model trained alone on its
    rows with its own optimizer (LoRA+ by ``create_loraplus_optimizer``), each PEFT dropout replaced by the keep-mask
    rows the operator drew for that task in that layer call: every gradient within 1e-5 of PEFT's (norm-relative;
    measured 1.5e-6) and the adapters within 1e-5 (fp32) after the steps, at the tenants' rates (5e-4; measured
    2.2e-6: Adam's first steps turn the rounding of near-zero gradient elements into differences that scale with the
    rate, 2.2e-5 at 5e-3)."""
    from lorafleet.executor.torch import multi_lora
    from lorafleet.executor.torch.optim import LORAPLUS_FACTORS, TaskOptimizer
    from lorafleet.executor.torch.worker import TaskTraining
    from lorafleet.specs.lora import OptimizerSpec
    from tests.helpers.trained_alone import reference_optimizer

    base = tiny_model("qwen2")
    model = copy.deepcopy(base)
    inject_multi_lora(model, DROPOUT_SPECS, seeds=[1, 2, 3])
    gen = torch.Generator().manual_seed(5)
    calls: list[str] = []  # the layer being called, set just before it draws its mask
    masks: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in multi_lora_layers(model):
            layer.train()
            layer.register_forward_pre_hook(lambda _module, _args, name=name: calls.append(name))
            for a in layer.adapters:  # moved off their start: B random, m != ||W||_c
                layer.factors(a)["lora_B"].copy_(torch.randn(layer.factors(a)["lora_B"].shape, generator=gen) * 0.1)
                if MAGNITUDE in layer.factors(a):
                    layer.factors(a)[MAGNITUDE].mul_(1.2)

    def recording(*args, **kwargs):
        keep = draw_keep_mask(*args, **kwargs)
        masks[calls[-1]] = keep
        return keep

    monkeypatch.setattr(multi_lora, "draw_keep_mask", recording)
    start = [{k: v.clone() for k, v in _factors(model, t).items()} for t in range(3)]
    optimizer_spec = OptimizerSpec(lr=5e-4, schedule="constant", weight_decay=0.01)
    trainings = [
        TaskTraining(name=f"t{i}", lora=spec, total_steps=2, optimizer=optimizer_spec)
        for i, spec in enumerate(DROPOUT_SPECS)
    ]
    references = [peft_model_of(base, model, t, DROPOUT_SPECS) for t in range(3)]
    ours = [
        TaskOptimizer(
            optimizer_spec,
            [p for _, _, p in _named_factors(model, t)],
            2,
            lr_ratio=spec.lr_ratio,
            fast=[p for _, factor, p in _named_factors(model, t) if factor in LORAPLUS_FACTORS],
        )
        for t, spec in enumerate(DROPOUT_SPECS)
    ]
    theirs = [reference_optimizer(reference, training) for reference, training in zip(references, trainings)]

    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # the mean token loss of one sequence
        return nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])

    for step in range(2):
        ids = torch.randint(0, 1024, (3, 7), generator=torch.Generator().manual_seed(10 + step))
        torch.manual_seed(step)
        with segments_context(model, Segments.padded([0, 1, 2], [7, 7, 7], 7)):
            logits = model(ids).logits
        sum(loss(logits[t : t + 1], ids[t : t + 1]) for t in range(3)).backward()
        assert all(not keep[:7].all() for keep in masks.values())  # every layer dropped some of task 0's inputs
        for t, reference in enumerate(references):
            for name, keep in masks.items():
                if t in dict(multi_lora_layers(model))[name].adapters:
                    target = reference.get_submodule(f"base_model.model.{name}")
                    target.lora_dropout["default"] = _Mask(keep[7 * t : 7 * (t + 1)], DROPOUT_SPECS[t].dropout)
            loss(reference(ids[t : t + 1]).logits, ids[t : t + 1]).backward()
            grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
            for name, factor, param in _named_factors(model, t):
                want = grads[f"base_model.model.{name}.{factor}.default.weight"]
                assert (param.grad - want).abs().max() <= 1e-5 * want.abs().max(), (step, t, name, factor)
            theirs[t].step()
            theirs[t].zero_grad()
            ours[t].step(0.0)
    for t, reference in enumerate(references):
        params = dict(reference.named_parameters())
        for name, factor, param in _named_factors(model, t):
            want = params[f"base_model.model.{name}.{factor}.default.weight"]
            assert (param - want).abs().max() <= ATOL[torch.float32], (t, name, factor)
        assert _max_diff(_factors(model, t), start[t]) > 20 * ATOL[torch.float32], t  # sanity: the steps moved it


def test_a_bf16_base_keeps_an_fp32_magnitude_and_tracks_the_fp32_layer():
    """Over a bf16 base the magnitude is an fp32 master like A and B; output, dX and every factor's gradient are
    within bf16 rounding of the fp32 layer's on the same mask (norm-relative, 2e-2; measured 0.4-0.7%)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    specs = [LoraSpec(rank=4, alpha=8, use_dora=True, dropout=0.1), LoraSpec(rank=2, alpha=2)]
    x, grad_y = torch.randn(12, 64), torch.randn(12, 48)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        layer = MultiLoraLinear(copy.deepcopy(linear).to(dtype)).train()
        gen = torch.Generator().manual_seed(1)
        for a, spec in enumerate(specs):
            weights = (torch.randn(spec.rank, 64, generator=gen) * 0.3, torch.randn(48, spec.rank, generator=gen) * 0.3)
            layer.add_adapter(a, spec, weights)
        layer.segments = Segments.packed([0, 1, 0], [5, 4, 3])
        x_in = x.to(dtype).detach().requires_grad_()
        torch.manual_seed(5)  # the same keep-mask in both
        y = layer(x_in)
        y.backward(grad_y.to(dtype))
        assert layer.lora_magnitude_vector["0"].dtype == torch.float32
        out[dtype] = [y.detach(), x_in.grad, *(p.grad for p in layer.factors(0).values())]
    for ours, oracle in zip(out[torch.bfloat16], out[torch.float32], strict=True):
        assert float((ours.float() - oracle).norm() / oracle.norm()) <= 2e-2


def test_export_loads_in_peft_merges_and_loads_back(trained, tmp_path):
    """The export is PEFT's: ``use_dora: true`` and the magnitudes under PEFT's keys (no ``.weight``); PeftModel loads
    it and gives the operator's logits, merged too; loaded back into a slot, it is the same adapter."""
    base, model, ids = trained
    path = save_peft_adapter(model, 2, tmp_path / "dora")
    pefts = tmp_path / "pefts"
    peft_model_of(base, model, 2, SPECS).save_pretrained(pefts)
    assert load_file(pefts / SAFETENSORS_WEIGHTS_NAME).keys() == load_file(path / SAFETENSORS_WEIGHTS_NAME).keys()
    assert json.loads((path / CONFIG_NAME).read_text())["use_dora"] is True
    keys = load_file(path / SAFETENSORS_WEIGHTS_NAME)
    assert keys["base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector"].shape == (64,)
    assert len(keys) == 3 * 2 * 2  # A, B and m of q_proj and down_proj in 2 layers
    with segments_context(model, Segments.packed([2], [ids[:1].numel()])), torch.no_grad():
        want = model(ids[:1]).logits
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    with torch.no_grad():
        assert (loaded(ids[:1]).logits - want).abs().max() <= 1e-5
        merged = loaded.merge_and_unload()
        assert (merged(ids[:1]).logits - want).abs().max() <= 1e-4
    target = copy.deepcopy(base)
    inject_multi_lora(target, SPECS[1:2])
    assert load_peft_adapter(target, path, 0) == SPECS[2].model_copy(update={"target_modules": ("down_proj", "q_proj")})
    with segments_context(target, Segments.packed([0], [ids[:1].numel()])), torch.no_grad():
        assert (target(ids[:1]).logits - want).abs().max() <= 1e-5


def test_a_dora_file_without_magnitudes_is_an_input_error(trained, tmp_path):
    _, model, _ = trained
    path = save_peft_adapter(model, 0, tmp_path / "dora")
    weights = load_file(path / SAFETENSORS_WEIGHTS_NAME)
    save_file({k: v for k, v in weights.items() if MAGNITUDE not in k}, path / SAFETENSORS_WEIGHTS_NAME)
    with pytest.raises(InputError, match="lora_magnitude_vector: missing"):
        load_peft_adapter(model, path, 0)


# ---- joint training on TP and PP replicas ------------------------------------------------------------------------

#: h.TASKS' names and data; two DoRA tenants (one with LoRA+), a plain LoRA+ one and a VeRA one (#41, ``vera.py``),
#: so micro-batches mix DoRA, LoRA and VeRA rows; "code" targets down_proj (row-parallel: its norm is all-reduced
#: under TP) and q/v (column-parallel), "summary" and the VeRA "summary-b" every projection.
DORA_TASKS = (
    replace(h.TASKS[0], lora=h.TASKS[0].lora.model_copy(update={"use_dora": True})),
    replace(h.TASKS[1], lora=h.TASKS[1].lora.model_copy(update={"use_dora": True, "lr_ratio": 4.0})),
    replace(h.TASKS[2], lora=h.TASKS[2].lora.model_copy(update={"lr_ratio": 8.0})),
    replace(h.TASKS[3], lora=LoraSpec(rank=16, use_vera=True, vera_prng_key=7)),
)
DORA_PLANS = {"tp2+pp2": h.plan_of((2, 1), (1, 2)), "tp2pp2-packed": h.plan_of((2, 2))}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("dora-fleet")
    runs = {
        "tp2+pp2": h.Run(
            DORA_PLANS["tp2+pp2"], STEPS, per_microbatch=3, out=str(root / "a"), tasks=DORA_TASKS, save_at=(2,)
        ),
        "tp2pp2-packed": h.Run(
            DORA_PLANS["tp2pp2-packed"], STEPS, packed=True, per_microbatch=4, out=str(root / "b"), tasks=DORA_TASKS
        ),
    }
    # After 2 steps, resumed on the other plan: the magnitudes and their Adam moments travel in the checkpoint.
    runs["resumed on tp2pp2"] = replace(
        runs["tp2pp2-packed"], out=str(root / "c"), resume_from=str(root / "a" / "ckpt")
    )
    h.run_world(4, list(runs.values()), root)
    out = {}
    for name, run in runs.items():
        final = latest_step_dir(Path(run.out) / "final")
        out[name] = {t.name: load_file(final / t.name / SAFETENSORS_WEIGHTS_NAME) for t in DORA_TASKS}
    out["checkpoint"] = latest_step_dir(root / "a" / "ckpt")
    return out


@pytest.fixture(scope="module")
def references():
    return {t.name: train_alone(i, torch.float32, tasks=DORA_TASKS) for i, t in enumerate(DORA_TASKS)}


def test_references_moved_their_magnitudes(references):
    """Sanity: PEFT trained the magnitudes (a DoRA task's file has them, moved off ||W||_c by more than the bound)."""
    base = h.build_model()
    for task in ("summary", "code"):
        mags = {k: v for k, v in references[task].items() if MAGNITUDE in k}
        assert mags and len(mags) == len([k for k in references[task] if "lora_A" in k])
        start = {k: base.get_submodule(k.removeprefix("base_model.model.").rsplit(".", 1)[0]).weight.norm(dim=1)
                 for k in mags}  # fmt: skip
        assert _max_diff(mags, start) > 20 * ATOL[torch.float32]
    assert not any(MAGNITUDE in k for k in references["chat"])


def test_references_moved_the_vera_vectors(references):
    """Sanity for the VeRA tenant (#41): PEFT's file of it is its vectors and projections, the vectors moved off
    their start (lambda_d = 0.1, lambda_b = 0) by more than the bound."""
    vera = references["summary-b"]
    assert {k.rpartition(".")[2] for k in vera} == {"vera_lambda_d", "vera_lambda_b", "vera_A", "vera_B"}
    start = {"vera_lambda_d": 0.1, "vera_lambda_b": 0.0}
    moved = max(float((v - start[k.rpartition(".")[2]]).abs().max()) for k, v in vera.items() if "lambda" in k)
    assert moved > 20 * ATOL[torch.float32]


@pytest.mark.parametrize("plan", [*DORA_PLANS, "resumed on tp2pp2"])
def test_joint_dora_training_equals_each_task_alone_with_peft(fleet, references, plan):
    for task in DORA_TASKS:
        assert _max_diff(fleet[plan][task.name], references[task.name]) <= ATOL[torch.float32], task.name


def test_a_resume_that_changes_an_adapters_kind_is_refused(fleet):
    """The checkpoint's "summary" is DoRA; a run that trains it as plain LoRA (or "chat" as DoRA) cannot resume."""
    step_dir = fleet["checkpoint"]
    names = [t.name for t in DORA_TASKS]
    state = load_train_state(step_dir, names)
    assert state.step == 2 and state.tasks[0].spec.use_dora and any(f == MAGNITUDE for _, f in state.tasks[0].weights)
    check_adapter_kinds(step_dir, state, [t.lora for t in DORA_TASKS])  # the same kinds: no error
    for task, plain_or_dora in ((0, False), (2, True)):
        loras = [t.lora for t in DORA_TASKS]
        loras[task] = loras[task].model_copy(update={"use_dora": plain_or_dora})
        with pytest.raises(InputError, match=f"{names[task]}: lora.use_dora: .* cannot change an adapter's kind"):
            check_adapter_kinds(step_dir, state, loras)


# ---- a DoRA tenant added at a boundary to a kept row-parallel stage ----------------------------------------------


def _add_dora_to_a_row_parallel_layer(_run: None) -> dict[str, float]:
    """Each rank of a TP2 group: a row-parallel ``down_proj`` training a plain LoRA tenant takes a DoRA tenant at a
    step boundary as a kept stage does (``change.change_slots``), then runs one forward and backward; the same on an
    unsplit layer. Rank 0 returns the largest relative gaps of every rank (magnitude, output, gradients)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from lorafleet.executor.torch.change import change_slots
    from lorafleet.executor.torch.tp import ParallelStyle, _shard_module

    rank, group = dist.get_rank(), dist.new_group([0, 1])
    specs = [LoraSpec(rank=2, alpha=4, target_modules=("down_proj",)), LoraSpec(rank=4, alpha=8, use_dora=True)]
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    plain = (torch.randn(2, 64, generator=gen), torch.randn(48, 2, generator=gen))
    x, grad_y, b_new = (
        torch.randn(6, 64, generator=gen),
        torch.randn(6, 48, generator=gen),
        torch.randn(48, 4, generator=gen),
    )
    layers = {}
    for tp in (1, 2):
        layer = MultiLoraLinear(copy.deepcopy(linear))
        layer.add_adapter(0, specs[0], plain)
        if tp == 2:
            layer = _shard_module(layer, ParallelStyle.ROW, rank, 2, group)
        holder = nn.Module()
        holder.down_proj = layer
        role = SimpleNamespace(tp_rank=rank if tp == 2 else 0, replica=SimpleNamespace(tp=tp))
        change_slots(holder, role, {0: 0}, specs, seeds=[0, 7], shapes={"down_proj": (64, 48)})  # collective at tp 2
        layers[tp] = layer
    whole, part = layers[1], layers[2]
    gaps = {"magnitude": float(((part.lora_magnitude_vector["1"] - whole.lora_magnitude_vector["1"]).abs()
                                / whole.lora_magnitude_vector["1"]).max())}  # fmt: skip
    for layer in (whole, part):
        with torch.no_grad():
            layer.lora_B["1"].copy_(b_new)  # B replicated on a row-parallel layer; the new tenant's is trained
        layer.segments = Segments.packed([0, 1, 0], [2, 3, 1])
    y_whole = whole(x)
    y_whole.backward(grad_y)
    y_part = part(x[:, 32 * rank : 32 * (rank + 1)].contiguous())
    y_part.backward(grad_y)
    y = y_part.detach().clone()
    dist.all_reduce(y, group=group)  # g: the row-parallel partial sums
    gaps["output"] = float((y - y_whole).abs().max() / y_whole.abs().max())
    for factor in ("lora_A", "lora_B", MAGNITUDE):
        want = getattr(whole, factor)["1"].grad
        got = getattr(part, factor)["1"].grad.clone()
        if factor == "lora_A":  # sharded on its inputs: this rank's columns
            want = want[:, 32 * rank : 32 * (rank + 1)]
        else:  # replicated: the ranks' partial gradients, summed by the gradient sync
            dist.all_reduce(got, group=group)
        gaps[factor] = float((got - want).abs().max() / want.abs().max())
    every: list = [None, None]
    dist.all_gather_object(every, gaps)
    return {key: max(g[key] for g in every) for key in gaps}


def test_a_dora_tenant_added_to_a_kept_row_parallel_stage_equals_the_unsplit_layer(tmp_path):
    """A DoRA tenant joining a running fleet on a TP2 replica's row-parallel layer: its magnitude, drawn over the
    rank's column slice, is the whole weight's ``||W||_c`` (the squared norms all-reduced over the TP group, in
    ``add_adapter``); a step's output and every gradient of it then equal the unsplit layer's (relative 1e-6)."""
    (gaps,) = h.run_world(2, [None], tmp_path, body=_add_dora_to_a_row_parallel_layer)
    assert set(gaps) == {"magnitude", "output", "lora_A", "lora_B", MAGNITUDE}
    assert all(gap <= 1e-6 for gap in gaps.values()), gaps
