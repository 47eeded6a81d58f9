"""Phi-3's fused projections under TP: each rank keeps its slice of every part, and every rule that cuts or reads a
shard (the in-memory split, the checkpoint's slices, the gradient sum's pieces) agrees on which rows those are."""

from __future__ import annotations

import torch
from torch import nn

from lorafleet.executor.torch.fused import (
    cut_points,
    group_rows_by_rank,
    holder,
    local_row,
    output_parts,
    shard_ranges,
)
from lorafleet.executor.torch.tp import ParallelStyle, _shard_module, base_index, shard

PARTS = output_parts("qkv_proj", 128, n_heads=4, n_kv_heads=2)  # q 64 | k 32 | v 32 rows


def test_parts_of_each_projection():
    assert PARTS == (64, 32, 32)
    assert output_parts("gate_up_proj", 352, 4, 2) == (176, 176)
    assert output_parts("q_proj", 64, 4, 2) == (64,)


def test_a_rank_keeps_its_slice_of_each_part_and_every_rule_agrees():
    """Rank j of 2 keeps q's, k's and v's j-th halves; the grouped contiguous split (``parallelize_tensor``),
    ``shard`` with parts (checkpoint restore), ``base_index``'s pieces (per-stage loading) and the pieces' row
    arithmetic (``grad_sync``) give the same rows."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(8, 128, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(128, 8, generator=gen))
        linear.bias.copy_(torch.randn(128, generator=gen))
    whole_weight, whole_bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    assert shard_ranges(PARTS, 1, 2) == [(32, 64), (80, 96), (112, 128)]
    grouped = nn.Linear(8, 128, bias=True)
    grouped.load_state_dict(linear.state_dict())
    group_rows_by_rank(grouped, PARTS, 2)
    for r in range(2):
        rows = [i for a, b in shard_ranges(PARTS, r, 2) for i in range(a, b)]
        want = whole_weight[rows]
        assert torch.equal(_shard_module(grouped, ParallelStyle.COLUMN, r, 2).weight, want)
        assert torch.equal(_shard_module(grouped, ParallelStyle.COLUMN, r, 2).bias, whole_bias[rows])
        assert torch.equal(shard(whole_weight, 0, r, 2, PARTS), want)
        pieces = base_index("model.layers.0.self_attn.qkv_proj", "weight", (128, 8), r, 2, PARTS)
        assert torch.equal(torch.cat([whole_weight[i] for i in pieces]), want)
        assert [local_row(i, PARTS, r, 2) for i in rows] == list(range(len(rows)))
        assert {holder(i, PARTS, 2) for i in rows} == {r}


def test_cut_points_split_every_part_at_every_tp_size():
    assert cut_points(PARTS, [1, 2]) == [0, 32, 64, 80, 96, 112, 128]
    assert cut_points((12,), [2, 3]) == [0, 4, 6, 8, 12]
