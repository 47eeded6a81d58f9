"""Micro-batch tensors, attention masks, and one stage's forward against the HF model's own."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F
from transformers import MistralConfig, Qwen2Config

from lorafleet.data.tokenize import IGNORE_INDEX
from lorafleet.executor.torch import attention
from lorafleet.executor.torch.attention import use_document_attention
from lorafleet.executor.torch.base_model import load_causal_lm
from lorafleet.executor.torch.inject import adapter_parameters, inject_multi_lora, multi_lora_layers, segments_context
from lorafleet.executor.torch.pipeline import split_for_pipeline
from lorafleet.executor.torch.routing import Segments
from lorafleet.executor.torch.step import attention_window, build_inputs, stage_forward, weighted_losses
from lorafleet.executor.torch.worker import check_step_plan
from lorafleet.plans import MicroBatch
from lorafleet.runtime.data_stream import loss_tokens
from lorafleet.runtime.layout import FleetLayout, ModelDims
from tests.helpers import fleet_harness as h
from tests.helpers.op_count import OpCount

STREAMS = h.synthetic_streams()
BATCH = STREAMS.global_batch(0)
EXAMPLES = STREAMS.examples(BATCH.task_ids, BATCH.sample_ids)
ROWS = (3, 4, 7, 10)  # tasks 1, 1, 2, 3: contiguous by task


def _microbatch(packed: bool) -> MicroBatch:
    lengths = tuple(int(BATCH.lengths[q]) for q in ROWS)
    return MicroBatch(ROWS, tuple(int(BATCH.task_ids[q]) for q in ROWS), lengths, None if packed else max(lengths) + 2)


@pytest.mark.parametrize("packed", [False, True])
def test_targets_weights_and_segments(packed):
    mb = _microbatch(packed)
    inv = [0.0, 1 / 11, 1 / 13, 1 / 17]
    inputs = build_inputs(mb, [EXAMPLES[q] for q in ROWS], inv, torch.device("cpu"))
    b, s = (1, sum(mb.lengths)) if packed else (4, mb.padded_len)
    assert inputs.input_ids.shape == (b, s)
    for task in (1, 2, 3):  # each task's weights add up to its loss tokens / N_t
        want = sum(loss_tokens(EXAMPLES[q]) for q in ROWS if BATCH.task_ids[q] == task) * inv[task]
        assert float(inputs.weights[inputs.token_task == task].sum()) == pytest.approx(want)
    assert ((inputs.targets == IGNORE_INDEX) == (inputs.weights == 0)).all()
    first = EXAMPLES[ROWS[0]]  # the target at position i is the label of token i + 1
    assert inputs.targets.view(-1)[: len(first) - 1].tolist() == list(first.labels[1:])
    seg = inputs.segments
    assert seg.adapter_ids == (1, 2, 3)
    if packed:
        assert seg == Segments.packed((1, 2, 3), (mb.lengths[0] + mb.lengths[1], mb.lengths[2], mb.lengths[3]))
    else:
        assert seg.starts == (0, 2 * s, 3 * s) and seg.lengths == (2 * s, s, s)


def test_attention_bounds_are_the_documents():
    """Packed: each sequence's slice of the row; padded: the whole row (padding after it)."""
    packed = build_inputs(_microbatch(True), [EXAMPLES[q] for q in ROWS], [1.0] * 4, torch.device("cpu"))
    lengths = [len(EXAMPLES[q]) for q in ROWS]
    assert packed.attention(None)["document_bounds"] == tuple(itertools.accumulate(lengths, initial=0))
    padded = build_inputs(_microbatch(False), [EXAMPLES[q] for q in ROWS], [1.0] * 4, torch.device("cpu"))
    assert padded.attention(3) == {
        "attention_mask": None,
        "document_bounds": (0, max(lengths) + 2),
        "document_window": 3,
    }


def test_padding_takes_no_gradient_and_changes_no_real_token():
    """Right padding under row-causal attention: the real tokens' logits do not depend on what
    the padding holds, and the padding's positions get exactly zero gradient."""
    model = h.build_model("llama", torch.float64)
    inject_multi_lora(model, [t.lora for t in h.TASKS])
    role = FleetLayout.of(h.plan_of((1, 1)), ModelDims.of(model.config), 1).role(0)
    split_for_pipeline(model, role)
    use_document_attention(model)
    mb = _microbatch(False)
    inputs = build_inputs(mb, [EXAMPLES[q] for q in ROWS], [1.0] * 4, torch.device("cpu"))
    real = torch.zeros(inputs.input_ids.shape, dtype=torch.bool)
    for k, n in enumerate(mb.lengths):
        real[k, :n] = True
    noisy = replace(inputs, input_ids=inputs.input_ids.masked_fill(~real, 7))
    with torch.no_grad():
        assert torch.equal(
            stage_forward(model, role, None, inputs)[real], stage_forward(model, role, None, noisy)[real]
        )
    embeds = model.model.embed_tokens(inputs.input_ids).detach().requires_grad_()
    hooks = model.model.embed_tokens.register_forward_hook(lambda *_: embeds)
    logits = stage_forward(model, role, None, inputs)
    hooks.remove()
    (
        logits.log_softmax(-1).gather(-1, inputs.targets.clamp(min=0)[..., None])[..., 0] * inputs.weights
    ).sum().backward()
    assert embeds.grad[~real].abs().max() == 0 and embeds.grad[real].abs().max() > 0


def test_attention_windows_by_family():
    assert attention_window(load_causal_lm(h.TINY).config, 0) is None
    assert attention_window(MistralConfig(sliding_window=16), 0) == 16
    qwen = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert [attention_window(qwen, i) for i in range(2)] == [None, 8]


@pytest.mark.parametrize(
    "family,packed",
    [
        ("llama", False),
        ("llama", True),
        ("qwen2", False),
        ("mistral", True),
        ("gemma2", True),
    ],
)
def test_stage_forward_equals_the_hf_model(family, packed):
    """A whole-model stage with random adapters gives, row for row, the logits of the HF model run
    one sequence at a time with that sequence's adapter (Gemma 2: its soft-capped attention and logits). The other
    newer families are held to the HF model through training (``test_joint_training``)."""
    model = h.build_model(family, torch.float64)
    inject_multi_lora(model, [t.lora for t in h.model_tasks(family)])
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    reference = copy.deepcopy(model)
    role = FleetLayout.of(h.plan_of((1, 1)), ModelDims.of(model.config), 1).role(0)
    split_for_pipeline(model, role)
    use_document_attention(model)
    mb = _microbatch(packed)
    inputs = build_inputs(mb, [EXAMPLES[q] for q in ROWS], [1.0] * 4, torch.device("cpu"))
    with torch.no_grad():
        logits = stage_forward(model, role, None, inputs)
        offset = 0
        for k, q in enumerate(ROWS):
            ids = torch.tensor([EXAMPLES[q].input_ids])
            with segments_context(reference, Segments.packed([int(BATCH.task_ids[q])], [ids.numel()])):
                want = reference(ids).logits[0]
            n = ids.numel()
            got = logits[0, offset : offset + n] if packed else logits[k, :n]
            offset += n
            assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("packed", [False, True])
def test_recompute_gives_the_same_loss_and_gradients_and_saves_less(packed):
    """Blocks under torch.utils.checkpoint re-run their forward in the backward with the first
    run's RNG state: with adapter dropout on, loss and every adapter gradient are bitwise those
    of the plain stage, while autograd keeps a fraction of the bytes."""
    tasks = [t.lora.model_copy(update={"dropout": 0.3}) for t in h.TASKS]
    model = h.build_model("llama", torch.float64)
    inject_multi_lora(model, tasks)
    for _, layer in multi_lora_layers(model):
        layer.train()  # dropout on, as build_replica leaves it
    with torch.no_grad():  # B = 0 at init would make every A gradient 0, equal without trying
        for p in adapter_parameters(model):
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    inputs = build_inputs(_microbatch(packed), [EXAMPLES[q] for q in ROWS], [1.0] * 4, torch.device("cpu"))
    results = []
    for recompute in (False, True):
        stage = copy.deepcopy(model)
        role = FleetLayout.of(h.plan_of((1, 1, recompute)), ModelDims.of(stage.config), 1).role(0)
        split_for_pipeline(stage, role)
        use_document_attention(stage)
        saved = []
        torch.manual_seed(5)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):  # noqa: B023
            loss = stage_forward(stage, role, None, inputs).square().mean()
        loss.backward()
        grads = [p.grad for p in adapter_parameters(stage) if p.grad is not None]  # task 0 has no rows here
        results.append((loss.detach(), grads, sum(saved)))
    (plain_loss, plain_grads, plain_bytes), (rc_loss, rc_grads, rc_bytes) = results
    assert torch.equal(plain_loss, rc_loss)
    assert len(plain_grads) == len(rc_grads) > 0 and all(g.abs().max() > 0 for g in plain_grads)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, rc_grads, strict=True))
    assert rc_bytes < plain_bytes / 2


def test_a_step_plan_must_place_every_sequence_exactly_once():
    plan = h.make_step_plan(BATCH, 2)
    check_step_plan(plan, BATCH, 2)
    first = plan.work[0].microbatches[0]
    dropped = replace(first, seq_ids=first.seq_ids[1:], task_ids=first.task_ids[1:], lengths=first.lengths[1:])
    broken = replace(
        plan, work=(replace(plan.work[0], microbatches=(dropped, *plan.work[0].microbatches[1:])), plan.work[1])
    )
    with pytest.raises(ValueError, match="in 0 micro-batches"):
        check_step_plan(broken, BATCH, 2)
    with pytest.raises(ValueError, match="work for 2 replicas"):
        check_step_plan(plan, BATCH, 3)
    wrong_length = replace(first, lengths=(first.lengths[0] + 1, *first.lengths[1:]))
    with pytest.raises(ValueError, match="does not match"):
        check_step_plan(
            replace(plan, work=(replace(plan.work[0], microbatches=(wrong_length,)), plan.work[1])), BATCH, 2
        )


def test_varlen_layout_and_choice():
    """The varlen kernel's document starts for rows laid end to end (padded rows: one document a
    row), and the kernel is taken only on CUDA in 16-bit without dropout; the CPU loops."""
    starts, longest = attention._cumulative_starts((0, 3, 7), 2, torch.device("cpu"))
    assert starts.tolist() == [0, 3, 7, 10, 14] and starts.dtype == torch.int32 and longest == 4
    starts, longest = attention._cumulative_starts((0, 5), 3, torch.device("cpu"))
    assert starts.tolist() == [0, 5, 10, 15] and longest == 5
    assert not attention.uses_varlen(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), 0.0)


@pytest.mark.parametrize("window", [None, 5])
def test_per_document_attention_is_each_document_alone_and_backward_writes_one_buffer(window):
    """Packed documents with grouped-query heads: output and gradients are, document by document, SDPA
    of that document alone with its keys and values repeated per query head (fp64); the backward cuts no
    per-document gradient out of a zero-filled copy of the whole row (no ``slice_backward``)."""
    gen = torch.Generator().manual_seed(3)
    bounds, heads, kv_heads, d = (0, 4, 13, 14, 30), 6, 2, 8
    q = torch.randn(1, heads, bounds[-1], d, dtype=torch.float64, generator=gen).requires_grad_()
    k, v = (torch.randn(1, kv_heads, bounds[-1], d, dtype=torch.float64, generator=gen).requires_grad_() for _ in "kv")
    grad = torch.randn(1, bounds[-1], heads, d, dtype=torch.float64, generator=gen)
    out = attention.per_document(q, k, v, bounds, window, scaling=0.3)
    with OpCount() as counted:
        got = torch.autograd.grad(out, (q, k, v), grad)
    assert "slice_backward" not in counted.ops and "fill_" not in counted.ops
    groups = heads // kv_heads
    for a, b in itertools.pairwise(bounds):
        qa, ka, va = (t[:, :, a:b].detach().requires_grad_() for t in (q, k, v))
        mask = None if window is None else attention._window_mask(b - a, window, q.device)
        want = F.scaled_dot_product_attention(
            qa,
            ka.repeat_interleave(groups, 1),
            va.repeat_interleave(groups, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=0.3,
        ).transpose(1, 2)
        assert (out[:, a:b] - want).abs().max() < 1e-12
        want_grads = torch.autograd.grad(want, (qa, ka, va), grad[:, a:b])
        for g, w in zip(got, want_grads, strict=True):
            assert (g[:, :, a:b] - w).abs().max() < 1e-12


@pytest.mark.parametrize("packed", [False, True])
def test_the_head_runs_on_loss_rows_only_and_changes_no_gradient(packed):
    """``weighted_losses`` runs the norm and LM head on the rows with a target only (counted at the head's
    input), and gives the weighted token losses and every adapter gradient of the full-logits loss (fp64)."""
    model = h.build_model("llama", torch.float64)
    inject_multi_lora(model, [t.lora for t in h.TASKS])
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    role = FleetLayout.of(h.plan_of((1, 1)), ModelDims.of(model.config), 1).role(0)
    split_for_pipeline(model, role)
    use_document_attention(model)
    inv = [0.0, 1 / 11, 1 / 13, 1 / 17]
    inputs = build_inputs(_microbatch(packed), [EXAMPLES[q] for q in ROWS], inv, torch.device("cpu"))
    rows = (inputs.targets.view(-1) != IGNORE_INDEX).nonzero().view(-1)
    assert torch.equal(inputs.loss_rows, rows) and 0 < len(rows) < inputs.targets.numel()
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape))
    weighted = weighted_losses(model, role, None, inputs)
    hook.remove()
    assert seen == [torch.Size([len(rows), model.config.hidden_size])]
    weighted.sum().backward()
    got = [p.grad.clone() for p in adapter_parameters(model) if p.grad is not None]
    model.zero_grad()
    logits = stage_forward(model, role, None, inputs)
    full = F.cross_entropy(
        logits.view(-1, logits.shape[-1]), inputs.targets.view(-1), reduction="none", ignore_index=IGNORE_INDEX
    ) * inputs.weights.view(-1)
    assert (weighted - full[rows]).abs().max() < 1e-12 and full[~torch.isin(torch.arange(full.numel()), rows)].eq(
        0
    ).all()
    full.sum().backward()
    want = [p.grad for p in adapter_parameters(model) if p.grad is not None]
    assert len(got) == len(want) > 0
    assert all((g - w).abs().max() < 1e-12 for g, w in zip(got, want, strict=True))
