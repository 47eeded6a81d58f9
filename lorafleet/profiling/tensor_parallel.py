"""Megatron-style tensor parallelism of a Llama block, enough to time it over gloo.

Each of ``tp`` ranks keeps a slice of every projection (before LoRA is injected, so the
adapters get the sliced shapes): q, k, v, gate and up split by output rows (column
parallel: whole heads, whole FFN channels), o and down split by input columns (row
parallel). Attention and MLP then each need one all-reduce of their output forward and one
of their input's gradient backward (Megatron's g and f operators)::

    x ──f──> [q k v | gate up]  (column parallel, local)  ──> ... ──> [o | down] ──g──> y
    f: forward identity, backward all-reduce      g: forward all-reduce, backward identity

Embedding, final norm and LM head stay replicated (each rank computes them in full).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lorafleet.costmodel.memory_model import COLUMN_PARALLEL



class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce autograd's buffer in place
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce forward (sum of the row-parallel partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)  # a new output, not the input modified in place
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _slice_linear(linear: nn.Linear, dim: int, rank: int, tp: int) -> nn.Linear:
    """The rank's 1/tp of ``linear`` along ``dim`` of its weight (0: output rows, 1: input columns)."""
    weight = linear.weight.detach().chunk(tp, dim=dim)[rank].clone()
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    out.weight = nn.Parameter(weight, requires_grad=False)
    return out


def shard_block(attention: nn.Module, mlp: nn.Module, rank: int, tp: int, group: dist.ProcessGroup) -> None:
    """Slice one block's projections for ``rank`` of ``tp`` in place and wrap attention and MLP in f and g.

    Attention reshapes with ``view(..., -1, head_dim)``, so sliced q/k/v simply carry fewer
    heads; the query-per-KV group size is unchanged because q and kv heads split alike.
    """
    for module, names in ((attention, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            dim = 0 if name in COLUMN_PARALLEL else 1
            setattr(module, name, _slice_linear(getattr(module, name), dim, rank, tp))

    def copy_in(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (_CopyToTensorParallel.apply(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _CopyToTensorParallel.apply(kwargs["hidden_states"], group)}

    def reduce_out(_module: nn.Module, _args: tuple, output: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (_ReduceFromTensorParallel.apply(output[0], group), *output[1:])
        return _ReduceFromTensorParallel.apply(output, group)

    for module in (attention, mlp):
        module.register_forward_pre_hook(copy_in, with_kwargs=True)
        module.register_forward_hook(reduce_out)
