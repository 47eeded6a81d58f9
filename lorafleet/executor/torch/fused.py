"""Fused projections under tensor parallelism: Phi-3's ``qkv_proj`` and ``gate_up_proj``.

A fused projection's output rows are its parts' laid end to end (``specs.architecture``):

    qkv_proj:      [ q (H d) | k (KV d) | v (KV d) ]        gate_up_proj:  [ gate (F) | up (F) ]

A column-parallel split into ``P`` contiguous blocks would give a rank some q heads and no v at all. So each part
is cut into ``P`` and TP rank ``j`` keeps its slice of every part, in part order (part ``p`` at row ``o_p``, of
``n_p`` rows):

    rows_j = ∪_p [o_p + j n_p / P, o_p + (j + 1) n_p / P)          (:func:`shard_ranges`)

Its local output is then ``[q_j | k_j | v_j]`` (whole heads of each: ``P`` divides H and KV) or ``[gate_j | up_j]``,
which the model's own forward splits as it splits the whole one: Phi-3's MLP halves it, and its attention cuts it at
its query width, which :func:`localize_attention` sets to the rank's ``H d / P``. The frozen weight's rows, an
adapter's ``B (out, r)`` rows and a DoRA magnitude are cut by the same rule; ``A (r, in)`` is replicated, as for any
column-parallel projection (``tp.py``). An unfused projection is the case of one part: one contiguous block.

Everything outside TP (checkpoints, the PEFT export, the gradient sum's pieces) sees whole matrices in the fused
layout above, PEFT's: only a rank's local shard is grouped by part.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lorafleet.executor.torch.dora import MAGNITUDE
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.vera import LAMBDA_B

FUSED_HEADS = "qkv_proj"
"""The fused attention projection: parts q, k, v, in heads of one width."""
FUSED_HALVES = "gate_up_proj"
"""The fused MLP projection: parts gate and up, of equal width."""


def output_parts(module: str, out_features: int, n_heads: int, n_kv_heads: int) -> tuple[int, ...]:
    """The widths of the parts whose rows a projection's ``out_features`` are (module doc); ``(out_features,)`` for an
    unfused one. ``module``: its name's last component."""
    if module == FUSED_HEADS:
        d = out_features // (n_heads + 2 * n_kv_heads)
        return n_heads * d, n_kv_heads * d, n_kv_heads * d
    if module == FUSED_HALVES:
        return out_features // 2, out_features // 2
    return (out_features,)


def shard_ranges(parts: Sequence[int], tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
    """The rows ``[start, stop)`` of the whole that TP rank ``tp_rank`` of ``tp_size`` keeps, one range per part, in
    the order its local shard holds them."""
    ranges, offset = [], 0
    for n in parts:
        if n % tp_size:
            raise ValueError(f"a part of {n} rows does not split over {tp_size} TP ranks")
        step = n // tp_size
        ranges.append((offset + tp_rank * step, offset + (tp_rank + 1) * step))
        offset += n
    return ranges


def shard_rows(t: Tensor, dim: int, parts: Sequence[int], tp_rank: int, tp_size: int) -> Tensor:
    """TP rank ``tp_rank``'s rows of ``t`` along ``dim``, part by part (a new tensor)."""
    pieces = [t.detach().narrow(dim, a, b - a) for a, b in shard_ranges(parts, tp_rank, tp_size)]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()


def group_rows_by_rank(module: nn.Module, parts: Sequence[int], tp_size: int) -> None:
    """Reorders, in place, the output rows of a fused projection (a linear, or a MultiLoraLinear: its frozen weight
    and bias, every adapter's ``B``, DoRA magnitude and VeRA ``λ_b``) so that TP rank ``j``'s rows
    (:func:`shard_ranges`) are the ``j``-th of ``tp_size`` contiguous blocks: ``tp.py``'s contiguous column split
    then gives each rank its part slices. Called on the whole model just before that split
    (``tp.parallelize_tensor``)."""

    def grouped(t: Tensor) -> Tensor:
        return torch.cat([shard_rows(t, 0, parts, j, tp_size) for j in range(tp_size)])

    linear = module.base_layer if isinstance(module, MultiLoraLinear) else module
    if type(linear) is not nn.Linear:
        raise TypeError(f"cannot split the fused rows of a {type(linear).__name__}")
    linear.weight = nn.Parameter(grouped(linear.weight), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(grouped(linear.bias), requires_grad=False)
    if isinstance(module, MultiLoraLinear):
        for factor in ("lora_B", MAGNITUDE, LAMBDA_B):
            weights: nn.ParameterDict = getattr(module, factor)
            for key in list(weights.keys()):
                weights[key] = nn.Parameter(grouped(weights[key]))


def cut_points(parts: Sequence[int], tp_sizes: Sequence[int]) -> list[int]:
    """Every boundary of a shard of some TP size in ``tp_sizes``, ascending, from 0 to the whole's rows: a block
    between two neighbours lies in one part and in one shard of every size."""
    cuts, offset = {0}, 0
    for n in parts:
        cuts |= {offset + n * j // p for p in tp_sizes for j in range(p + 1)}
        offset += n
    return sorted(cuts)


def holder(row: int, parts: Sequence[int], tp_size: int) -> int:
    """The TP rank (of ``tp_size``) whose shard holds row ``row`` of the whole."""
    offset = 0
    for n in parts:
        if row < offset + n:
            return (row - offset) * tp_size // n
        offset += n
    raise ValueError(f"row {row} is past the {offset} rows of the parts {tuple(parts)}")


def local_row(row: int, parts: Sequence[int], tp_rank: int, tp_size: int) -> int:
    """Where row ``row`` of the whole (held by ``tp_rank``) sits in that rank's shard."""
    local = 0
    for start, stop in shard_ranges(parts, tp_rank, tp_size):
        if start <= row < stop:
            return local + row - start
        local += stop - start
    raise ValueError(f"TP rank {tp_rank} of {tp_size} does not hold row {row}")


def localize_attention(model: nn.Module, tp_size: int) -> None:
    """Gives every attention block with a fused ``qkv_proj`` the head counts of one TP rank's shard: Phi-3's
    attention cuts its local ``[q_j | k_j | v_j]`` at ``config.num_attention_heads * head_dim`` and
    ``num_key_value_heads * head_dim``, so each block gets its own copy of the config with ``H / P`` and ``KV / P``
    heads (the model's config, shared by the rest, keeps the whole model's)."""
    for module in model.modules():
        if isinstance(getattr(module, FUSED_HEADS, None), nn.Module) and hasattr(module, "num_key_value_heads"):
            local = copy.copy(module.config)
            local.num_attention_heads = module.config.num_attention_heads // tp_size
            local.num_key_value_heads = module.config.num_key_value_heads // tp_size
            module.config = local
            module.num_key_value_heads = local.num_key_value_heads
