"""Megatron tensor parallelism for the decoder projections and their LoRA adapters.

With ``P`` TP ranks, a linear ``y = x W^T`` (``W (N, K)``) is split in one of two styles:

- **column-parallel** (q, k, v, gate, up): rank ``j`` holds rows ``W_j`` of ``W`` (``N/P``
  outputs, whole heads), computes ``y_j = x W_j^T`` and keeps it local; the next row-parallel
  layer consumes it. The input ``x`` is replicated, so its gradient is the sum of the ranks'
  partial gradients: operator ``f`` (identity forward, all-reduce backward).
- **row-parallel** (o, down): rank ``j`` holds columns ``W_j`` (``K/P`` inputs), receives the
  matching slice ``x_j`` and computes a partial sum; ``y = Σ_j x_j W_j^T``: operator ``g``
  (all-reduce forward, identity backward). A bias is added once, on TP rank 0.

An adapter ``y += s B A x`` is split so that it needs no communication of its own:

- column-parallel base: ``A (r, K)`` replicated, ``B (N, r)`` sharded on its output rows:
  ``y_j += s B_j (A x)``;
- row-parallel base: ``A`` sharded on its input columns, ``B`` replicated:
  ``Σ_j s B (A_j x_j) = s B (A x)``, so the adapter's partial sums ride on the base layer's
  all-reduce ``g`` (the r-sized ``A_j x_j`` are summed inside the ``(T, N)`` one).

A fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) is column-parallel part by part: each rank keeps its
slice of every part it fuses (``fused.py``).

A DoRA magnitude ``m (N,)`` is split like ``B``'s rows; a row-parallel layer's DoRA norm needs whole rows of
``W + s B A``, so it sums the ranks' squared norms (``dora.py``, one all-reduce over the TP group).

A VeRA adapter's ``λ_b (N,)`` is split like ``B``'s rows, its ``λ_d (r,)`` replicated; the layer keeps the rows and
columns of the shared frozen projections its shard uses (``vera.ProjectionSlice``: rows of ``B`` for column, columns
of ``A`` for row), so ``A' = diag(λ_d) A`` and ``B' = diag(λ_b) B`` are split as a LoRA's ``A`` and ``B`` are.

The replicated factor of each style then gets a *partial* gradient on each TP rank
(``dA = Σ_j s (G_j B_j)^T x`` for column, ``dB = Σ_j s G^T (A_j x_j)`` for row): the
adapter-gradient sum over every holder (``grad_sync``) completes it. Frozen base weights need
no gradient at all.

**The column-parallel backward: token-split inputs** (``token_split.py``, always on at TP > 1). ``dA`` needs the
input ``x (T, K)``, which every rank has whole in the forward; saving it whole for the backward would cost every
rank ``T K`` a column-parallel group. Rank ``j`` saves only its rows ``R_j`` (``ceil(T / P)`` a rank, the last
ones fewer) and, per adapter (segments as in ``multi_lora``, ``c = s / (1 - p)``, ``M`` the dropout keep-mask):

    dS'_j    = c G_j B_j                         (T, r)   the rank's partial, as before
    dS'[R_j] = Σ_i dS'_i[R_j]                    one reduce-scatter of dS' over the TP group (T r_max elements)
    dA_j     = dS'[R_j]^T (x[R_j] ⊙ M[R_j])     (r, K)   a partial over tokens instead of over outputs
    dx_j     = G_j W_j + (dS'_j A) ⊙ M           (T, K)   unchanged, summed by ``f``'s all-reduce

``Σ_j dA_j = dS'^T (x ⊙ M) = dA``, and ``grad_sync``'s plain sum over the holders of ``A`` (all the TP ranks)
completes it as before. The sums run in another order than over whole inputs: equal within rounding, not bitwise.
The mask stays whole (``dx`` reads it on every row), and the ranks of a stage must draw the same one. A DoRA
adapter's rescale (``dora.py``) saves what it saved before (its ``dx`` term needs nothing of ``dA``); a VeRA
adapter saves no input at all (``A`` is frozen). One rank (TP 1) saves ``x`` whole, with no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lorafleet.executor.torch.dora import MAGNITUDE
from lorafleet.executor.torch.fused import (
    FUSED_HALVES,
    FUSED_HEADS,
    group_rows_by_rank,
    localize_attention,
    output_parts,
    shard_ranges,
    shard_rows,
)
from lorafleet.executor.torch.inject import module_suffix
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.quantized_base import QuantizedLinear
from lorafleet.executor.torch.token_split import TokenSplit
from lorafleet.executor.torch.vera import LAMBDA_B, LAMBDA_D, ProjectionSlice


class ParallelStyle(StrEnum):
    COLUMN = "column"
    ROW = "row"


#: How each decoder projection is split (Megatron-LM; the same names in every supported family, Phi-3's fused ones
#: column-parallel part by part: ``fused.py``).
TP_STYLES: dict[str, ParallelStyle] = {
    "q_proj": ParallelStyle.COLUMN,
    "k_proj": ParallelStyle.COLUMN,
    "v_proj": ParallelStyle.COLUMN,
    "gate_proj": ParallelStyle.COLUMN,
    "up_proj": ParallelStyle.COLUMN,
    "o_proj": ParallelStyle.ROW,
    "down_proj": ParallelStyle.ROW,
    FUSED_HEADS: ParallelStyle.COLUMN,
    FUSED_HALVES: ParallelStyle.COLUMN,
}


def weight_shard_dim(style: ParallelStyle) -> int:
    """The dim of ``W (N, K)`` that is split: 0 (outputs) for column, 1 (inputs) for row."""
    return 0 if style is ParallelStyle.COLUMN else 1


def adapter_shard_dim(style: ParallelStyle, factor: str) -> int | None:
    """The dim of ``lora_A (r, K)``, ``lora_B (N, r)``, a DoRA ``lora_magnitude_vector (N,)`` or a VeRA
    ``vera_lambda_d (r,)`` / ``vera_lambda_b (N,)`` that is split; None when replicated."""
    if factor == LAMBDA_D:  # (r,): neither of W's dims
        return None
    if factor == LAMBDA_B:  # (N,): split like B's rows
        return 0 if style is ParallelStyle.COLUMN else None
    if factor == "lora_A":
        return None if style is ParallelStyle.COLUMN else 1
    if factor in ("lora_B", MAGNITUDE):  # a DoRA magnitude (N,) is split like B's rows
        return 0 if style is ParallelStyle.COLUMN else None
    raise ValueError(f"unknown adapter factor {factor!r}")


def base_shard_dim(style: ParallelStyle, tensor: str) -> int | None:
    """The dim of a projection's frozen ``weight (N, K)`` or ``bias (N,)`` that is split; None when
    whole (a row-parallel bias, held by TP rank 0 only: :func:`holds_bias`)."""
    if tensor == "weight":
        return weight_shard_dim(style)
    if tensor == "bias":
        return 0 if style is ParallelStyle.COLUMN else None
    raise ValueError(f"unknown projection tensor {tensor!r}")


def holds_bias(style: ParallelStyle, tp_rank: int) -> bool:
    """Whether TP rank ``tp_rank`` keeps the projection's bias. Row-parallel: the bias is added
    once (on rank 0) before the all-reduce sums the ranks."""
    return style is ParallelStyle.COLUMN or tp_rank == 0


def shard_index(shape: Sequence[int], dim: int | None, tp_rank: int, tp_size: int) -> tuple[slice, ...]:
    """Rank ``tp_rank``'s contiguous slice of a tensor of ``shape`` along ``dim``, as an index
    (``t[index]``); the whole tensor when ``dim`` is None.

    :func:`shard` cuts a tensor in memory with it, and per-stage loading
    (``replica.build_replica`` with ``weights``) reads the same slice from a checkpoint.
    """
    index = [slice(None)] * len(shape)
    if dim is not None:
        size = shape[dim]
        if size % tp_size:
            raise ValueError(f"dim {dim} of size {size} does not split over {tp_size} TP ranks")
        step = size // tp_size
        index[dim] = slice(tp_rank * step, (tp_rank + 1) * step)
    return tuple(index)


def base_index(
    module_name: str, tensor: str, shape: Sequence[int], tp_rank: int, tp_size: int, parts: Sequence[int] = ()
) -> list[tuple[slice, ...]]:
    """The part of a frozen base tensor of the whole model (``shape``) that TP rank ``tp_rank`` keeps, as the
    indices of its pieces, in the order the shard lays them end to end: a projection's slice, as
    :func:`parallelize_tensor` cuts it (a fused one's: one slice per part), or the whole for any other module.

    Args:
        module_name: the module's name in the model before injection (``model.layers.0.mlp.down_proj``).
        tensor: its tensor (``weight``, ``bias``).
        parts: a fused projection's part widths (``fused.output_parts``); empty for one part.
    """
    style = TP_STYLES.get(module_suffix(module_name))
    if style is None or tp_size == 1:  # parallelize_tensor leaves everything whole on one rank
        return [shard_index(shape, None, tp_rank, tp_size)]
    dim = base_shard_dim(style, tensor)
    if dim != 0 or len(parts) < 2:
        return [shard_index(shape, dim, tp_rank, tp_size)]
    whole = [slice(None)] * len(shape)
    return [(slice(a, b), *whole[1:]) for a, b in shard_ranges(parts, tp_rank, tp_size)]


def shard(t: Tensor, dim: int | None, tp_rank: int, tp_size: int, parts: Sequence[int] = ()) -> Tensor:
    """Rank ``tp_rank``'s slice of ``t`` along ``dim`` (a copy): contiguous, or with a fused projection's ``parts``
    (along its rows) its slice of each part (``fused.shard_rows``); the whole when dim is None."""
    if dim is not None and len(parts) > 1:
        return shard_rows(t, dim, parts, tp_rank, tp_size)
    return t.detach()[shard_index(t.shape, dim, tp_rank, tp_size)].clone()


class _CopyToTP(torch.autograd.Function):
    """``f``: identity forward; the backward sums the partial input gradients of the TP ranks."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """``g``: all-reduce forward (partial sums -> full output); identity backward."""

    @staticmethod
    def forward(ctx, y: Tensor, group: dist.ProcessGroup) -> Tensor:
        y = y.contiguous()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def sliced_linear(
    linear: nn.Linear | QuantizedLinear, style: ParallelStyle, tp_rank: int, tp_size: int
) -> nn.Linear | QuantizedLinear:
    """A frozen ``nn.Linear`` holding this rank's slice of ``linear`` (of a quantized one: its stored bytes)."""
    if isinstance(linear, QuantizedLinear):
        return linear.sliced(weight_shard_dim(style), tp_rank, tp_size, holds_bias(style, tp_rank))
    weight = shard(linear.weight, base_shard_dim(style, "weight"), tp_rank, tp_size)
    bias = None
    if linear.bias is not None and holds_bias(style, tp_rank):
        bias = shard(linear.bias, base_shard_dim(style, "bias"), tp_rank, tp_size)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out.requires_grad_(False)


def vera_slice(
    style: ParallelStyle, in_features: int, out_features: int, tp_rank: int, tp_size: int, parts: Sequence[int] = ()
) -> ProjectionSlice:
    """The rows of a VeRA ``B`` and columns of its ``A`` that TP rank ``tp_rank`` of a whole ``(out, in)`` projection
    uses: a column-parallel rank its output rows (a fused one's: its slice of every part, ``fused.shard_ranges``),
    a row-parallel rank its input columns."""
    if style is ParallelStyle.COLUMN:
        return ProjectionSlice(tuple(shard_ranges(parts or (out_features,), tp_rank, tp_size)), (0, in_features))
    (cols,) = shard_index((in_features,), 0, tp_rank, tp_size)
    return ProjectionSlice(((0, out_features),), (cols.start, cols.stop))


def _shard_module(
    module: nn.Module,
    style: ParallelStyle,
    tp_rank: int,
    tp_size: int,
    group: dist.ProcessGroup | None = None,
    parts: Sequence[int] = (),
) -> nn.Module:
    """This rank's part of a projection: a sliced ``nn.Linear``, or a MultiLoraLinear whose base
    and adapters are sliced in place (so module and parameter names stay the model's own); a
    row-parallel one sums its DoRA norms over ``group`` (``dora.py``), a column-parallel one saves its rank's rows
    of its input for ``dA`` (``token_split.py``). ``parts``: a fused projection's (``fused.output_parts``)."""
    if isinstance(module, MultiLoraLinear):
        module.vera_slice = vera_slice(style, module.in_features, module.out_features, tp_rank, tp_size, parts)
        module.base_layer = sliced_linear(module.base_layer, style, tp_rank, tp_size)
        module.norm_group = group if style is ParallelStyle.ROW else None
        column = style is ParallelStyle.COLUMN and tp_size > 1
        module.token_split = TokenSplit(tp_rank, tp_size, group) if column else None
        for factor in ("lora_A", "lora_B", MAGNITUDE, LAMBDA_D, LAMBDA_B):
            weights: nn.ParameterDict = getattr(module, factor)
            dim = adapter_shard_dim(style, factor)
            for key in list(weights.keys()):
                weights[key] = nn.Parameter(shard(weights[key], dim, tp_rank, tp_size))
        return module
    if isinstance(module, (nn.Linear, QuantizedLinear)):
        return sliced_linear(module, style, tp_rank, tp_size)
    raise TypeError(f"cannot tensor-parallelise a {type(module).__name__}")


def _input_hook(group: dist.ProcessGroup):
    """A forward pre-hook applying ``f`` to a block's input (positional or ``hidden_states=``)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (_CopyToTP.apply(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _CopyToTP.apply(kwargs["hidden_states"], group)}

    return hook


def _output_hook(group: dist.ProcessGroup):
    """A forward hook applying ``g`` to a row-parallel projection's partial output."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return _ReduceFromTP.apply(output, group)

    return hook


def parallelize_tensor(model: nn.Module, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None) -> list[str]:
    """Shards every decoder projection of ``model`` in place for TP rank ``tp_rank`` of ``tp_size``.

    ``f`` is applied once per block (attention, MLP), on the block's input, not once per
    projection: q, k and v share one input, so one all-reduce of its gradient serves all three.

    A fused projection's rows are first grouped by rank (``fused.group_rows_by_rank``), so the contiguous
    column split gives each rank its slice of every part, and its attention block is told the rank's head counts
    (``fused.localize_attention``).

    Returns:
        The names of the sharded projections.
    """
    names = [name for name, _ in model.named_modules() if module_suffix(name) in TP_STYLES]
    if tp_size == 1:
        return names
    if group is None:
        raise ValueError("tensor parallelism over more than one rank needs a process group")
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    blocks: dict[str, nn.Module] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        style = TP_STYLES[child]
        module = getattr(parent, child)
        parts = output_parts(child, module.out_features, heads, kv_heads)
        if len(parts) > 1:
            group_rows_by_rank(module, parts, tp_size)
        sharded = _shard_module(module, style, tp_rank, tp_size, group, parts)
        setattr(parent, child, sharded)
        if style is ParallelStyle.COLUMN:
            blocks[parent_name] = parent
        else:
            sharded.register_forward_hook(_output_hook(group))
    for block in blocks.values():
        block.register_forward_pre_hook(_input_hook(group), with_kwargs=True)
    localize_attention(model, tp_size)
    return names
