"""Token-split LoRA inputs of column-parallel projections (``token_split.py``): on a TP2 gloo group every gradient, the
input gradient and the loss equal the unsplit model's, for LoRA, DoRA, rsLoRA with dropout and VeRA, with and without
recomputation, over a row count TP does not divide; each rank saves half of a column-parallel group's input; and
the test fails when the collective does not sum."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lorafleet.executor.torch.dropout import draw_keep_mask
from lorafleet.executor.torch.inject import inject_multi_lora, module_suffix, multi_lora_layers
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.routing import LoraBackend, LoraRouting, Segments
from lorafleet.executor.torch.token_split import TokenSplit, share_routing
from lorafleet.executor.torch.tp import TP_STYLES, adapter_shard_dim, parallelize_tensor, shard
from lorafleet.specs.lora import LoraSpec
from tests.executor.torch.conftest import build_tiny_model
from tests.executor.torch.test_vera import _moved
from tests.executor.torch.token_split_cases import assert_results_close, split_forward_backward
from tests.helpers import fleet_harness as h
from tests.helpers.segment_lora_cases import (
    CASE_IDS,
    CASE_PARAMS,
    case_routing,
    case_tensors,
    forward_backward,
)

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
SPECS = [
    LoraSpec(rank=4, alpha=8),
    LoraSpec(rank=6, alpha=12, use_dora=True, target_modules=("q_proj", "v_proj", "down_proj", "up_proj")),
    # dropout on column-parallel layers only: a row-parallel rank draws a (T, K/2) mask, not the unsplit model's
    LoraSpec(rank=8, alpha=4, use_rslora=True, dropout=0.3, target_modules=COLUMN),
    LoraSpec(rank=5, use_vera=True, vera_prng_key=3, target_modules=("k_proj", "gate_proj", "o_proj")),
]
SEGMENTS = Segments.packed([0, 1, 2, 3], [5, 6, 4, 6])  # 21 rows: odd, so the ranks keep 11 and 10


def _step(model: nn.Module, recompute: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One training forward and backward of a 21-token micro-batch: the loss and the input gradient ``dX``. The
    layers keep their segments (a recomputed block re-runs outside any context); the dropout masks come from one
    seed, the same on both ranks and for the unsplit model."""
    model.train()
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for _, layer in multi_lora_layers(model):
        layer.segments = SEGMENTS
    ids = torch.randint(0, 1024, (1, SEGMENTS.end), generator=torch.Generator().manual_seed(2))
    x = model.model.embed_tokens(ids).detach().requires_grad_(True)
    torch.manual_seed(11)
    loss = model(inputs_embeds=x, use_cache=False).logits.square().mean()
    loss.backward()
    return loss.detach(), x.grad


def _tp2_against_unsplit(recompute: bool) -> dict[str, float]:
    """Rank ``j`` of a TP2 group: the largest relative gap of each quantity to the unsplit model's, the replicated
    factors' gradients summed over the group first (what ``grad_sync``'s sum over a factor's holders does)."""
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    whole = build_tiny_model("llama")
    inject_multi_lora(whole, SPECS, seeds=list(range(1, len(SPECS) + 1)))
    _moved(whole)
    part = copy.deepcopy(whole)
    parallelize_tensor(part, rank, 2, group)
    (loss, dx), (loss_tp, dx_tp) = _step(whole, recompute), _step(part, recompute)
    gaps = {"loss": float((loss_tp - loss).abs() / loss.abs()), "dX": float((dx_tp - dx).abs().max() / dx.abs().max())}
    for (name, w_layer), (_, p_layer) in zip(multi_lora_layers(whole), multi_lora_layers(part), strict=True):
        style = TP_STYLES[module_suffix(name)]
        for task in w_layer.adapters:
            for factor, param in p_layer.factors(task).items():
                dim = adapter_shard_dim(style, factor)
                grad = param.grad.clone()
                if dim is None:
                    dist.all_reduce(grad, group=group)
                want = shard(w_layer.factors(task)[factor].grad, dim, rank, 2)
                key = f"{task} {factor} {style.value}"  # tasks: 0 LoRA, 1 DoRA, 2 rsLoRA, 3 VeRA
                gaps[key] = max(gaps.get(key, 0.0), float((grad - want).abs().max() / want.abs().max()))
    every: list = [None, None]
    dist.all_gather_object(every, gaps)
    return {key: max(g[key] for g in every) for key in gaps}


@pytest.mark.parametrize("recompute", [False, True])
def test_tp2_token_split_equals_the_unsplit_model(tmp_path, recompute):
    """Every adapter gradient (A of a column-parallel layer now a partial over tokens), dX and the loss equal the
    unsplit model's within fp32 rounding: LoRA, DoRA, rsLoRA with dropout, VeRA; recomputed or not."""
    (gaps,) = h.run_world(2, [recompute], tmp_path, body=_tp2_against_unsplit)
    assert {"0 lora_A column", "1 lora_A column", "2 lora_A column", "3 vera_lambda_d column"} <= set(gaps), gaps
    assert all(gap <= 1e-5 for gap in gaps.values()), gaps


def test_a_collective_that_does_not_sum_is_caught(tmp_path, monkeypatch):
    """With the reduce-scatter replaced by a rank's own partial rows (no sum), the column-parallel ``A`` gradients
    are wrong: the comparison above can fail."""

    def unsummed(self: TokenSplit, buffer: torch.Tensor, total: int) -> torch.Tensor:
        first, end = self.bounds(total)
        return buffer[first:end]

    monkeypatch.setattr(TokenSplit, "reduce", unsummed)  # the forked ranks inherit it
    (gaps,) = h.run_world(2, [False], tmp_path, body=_tp2_against_unsplit)
    assert gaps["0 lora_A column"] > 1e-2, gaps
    assert gaps["0 lora_B column"] <= 1e-5, gaps  # only A's backward reads the split


def _saved_input_bytes(layers: list[MultiLoraLinear], x: torch.Tensor) -> int:
    """Bytes of the distinct storages of the ``(rows, K)`` tensors of ``x``'s dtype the layers' forwards on
    ``x (T, K)`` save, rows ``T`` or ``ceil(T / 2)`` (the input or a rank's rows of it; not a weight, whose rows are
    its outputs, nor a bool keep-mask)."""
    storages: dict[int, int] = {}
    tokens = x.shape[0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2 and t.shape[1] == x.shape[1] and t.shape[0] in (tokens, -(-tokens // 2)) and t.dtype == x.dtype:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in layers:
            layer(x)
    return sum(storages.values())


@pytest.mark.parametrize("tokens", [21, 64])
def test_a_column_parallel_group_saves_its_rank_share_of_the_input(tokens):
    """q, k and v share one input: with the token split a rank saves one copy of its ``ceil(T / 2)`` rows for the
    three of them (``T K / 2`` bytes, not ``T K``); a VeRA-only layer saves no input at all."""
    hidden, spec = 64, LoraSpec(rank=4, alpha=8)
    group = [MultiLoraLinear(nn.Linear(hidden, 48)) for _ in range(3)]
    for layer in group:
        layer.add_adapter(0, spec)
        layer.segments = Segments.packed([0], [tokens])
    x = torch.randn(tokens, hidden, requires_grad=True)
    whole = _saved_input_bytes(group, x)
    for layer in group:
        layer.token_split = TokenSplit(0, 2, None)  # a forward runs no collective
    split = _saved_input_bytes(group, x)
    assert (whole, split) == (tokens * hidden * 4, -(-tokens // 2) * hidden * 4)
    vera_only = _vera_layer(hidden, tokens)
    assert _saved_input_bytes([vera_only], x) == 0


def test_a_dropping_dora_group_saves_no_float_factor():
    """DoRA with dropout: a q/k/v group saves its rank's rows of the input and no ``(T, K)`` float beside them (the
    rescale's dropout term remakes its factor from the bool mask in the backward, ``dora._DropoutDelta``)."""
    hidden, tokens = 64, 21
    group = [MultiLoraLinear(nn.Linear(hidden, 48)).train() for _ in range(3)]
    for layer in group:
        layer.add_adapter(0, LoraSpec(rank=4, alpha=8, use_dora=True, dropout=0.2))
        layer.segments = Segments.packed([0], [tokens])
        layer.token_split = TokenSplit(0, 2, None)
    x = torch.randn(tokens, hidden, requires_grad=True)
    assert _saved_input_bytes(group, x) == -(-tokens // 2) * hidden * 4


def _vera_layer(hidden: int, tokens: int) -> MultiLoraLinear:
    from lorafleet.executor.torch.vera import VeraProjections, draw_projections

    layer = MultiLoraLinear(nn.Linear(hidden, 48))
    layer.add_adapter(0, LoraSpec(rank=4, use_vera=True), projections=VeraProjections(*draw_projections(4, 0, 64, 48)))
    layer.segments = Segments.packed([0], [tokens])
    return layer


@pytest.mark.parametrize(("total", "size"), [(21, 2), (64, 8), (3, 4), (1, 2)])
def test_the_ranks_rows_cover_the_tokens_once(total, size):
    """``ceil(T / P)`` rows a rank, the last ones fewer (or none): the shares tile ``[0, T)``, and a routing
    restricted to them keeps every segment's rows exactly once."""
    splits = [TokenSplit(j, size, None) for j in range(size)]
    bounds = [s.bounds(total) for s in splits]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    routing = LoraRouting(Segments.packed([1, 0], [total - total // 2, total // 2]), (1.0, 2.0), (0.0, 0.1))
    covered = []
    for first, end in bounds:
        for a, start, length in share_routing(routing, first, end).segments:
            covered += [(a, first + start + i) for i in range(length)]
    assert sorted(covered) == sorted((a, s + i) for a, s, n in routing.segments for i in range(n))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("tile,K,N,ranks,segments", CASE_PARAMS, ids=CASE_IDS)
def test_the_ranks_partials_sum_to_the_whole_input_gradient(tile, K, N, ranks, segments, dropout, size):
    """Mixed ranks, empty segments, an adapter owning two, padding rows, a rank owning none of an adapter's rows:
    the ranks' ``dA`` partials over their rows sum to the whole input's ``dA`` (fp32), the rest is unchanged."""
    tensors = case_tensors(K, N, ranks, segments)
    routing = case_routing(ranks, segments, dropout)
    torch.manual_seed(0)
    keep = draw_keep_mask(tensors.x.shape[0], K, routing, device="cpu")
    got = split_forward_backward(LoraBackend.TORCH, tensors, routing, keep, size)
    want = forward_backward(LoraBackend.TORCH, tensors, routing, keep)
    assert_results_close(got, want, len(ranks), 1e-5)
