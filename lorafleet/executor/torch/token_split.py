"""Sequence-parallel (token-split) LoRA inputs of a column-parallel projection: each TP rank saves 1/P of the rows.

On TP rank ``j`` of ``P``, a column-parallel projection gets its input ``X (T, K)`` whole (``tp.py``'s ``f``); a
replicated ``A (r, K)`` and the rank's rows ``B_j`` of ``B`` give the partial input gradient of the rank-``r``
product (``multi_lora``'s module doc, per segment, ``c = s / (1 - p)``):

    dS'_j = c G_j B_j                                      (T, r)   partial over the TP ranks

The LoRA weight gradient needs the input: ``dA = Σ_j dS'_j^T Xd``. Saving ``X`` whole for it costs every rank
``T K`` elements a column-parallel group (q, k and v share one input). Instead rank ``j`` saves only its rows
``R_j = [j c, min((j + 1) c, T))``, ``c = ceil(T / P)`` (the last ranks may have fewer, or none: an uneven split,
no padding of ``X``), and the backward sums ``dS'`` over the group for the rank's rows only:

    dS'[R_j] = Σ_i dS'_i[R_j]                  one reduce-scatter of the (P c, r_max) zero-padded dS'
    dA_j     = dS'[R_j]^T Xd[R_j]              per adapter, over its segments' rows within R_j

``Σ_j dA_j = dS'^T Xd = dA``: each ``dA_j`` is a partial over tokens where it used to be a partial over output
rows, and the adapter-gradient sum over every holder of ``A`` (``grad_sync``: all TP ranks, a plain sum, nothing
divided by P) completes it as it did. The forward is unchanged (``S = Xd A^T`` needs the whole ``X``, which the
rank has in the forward), and so is ``dX``: ``dX_j = G_j W_j + (dS'_j A) ⊙ M`` from the partial ``dS'_j`` over
every row, summed by ``f``'s all-reduce. Results are not bitwise those of the whole input (``dA`` is summed in
another order: over ranks of rows instead of over ranks of outputs), equal within float rounding.

The collective is ``dist.reduce_scatter_single`` (NCCL's reduce-scatter; gloo has it too in torch 2.13): one
per adapted column-parallel projection call with a LoRA or DoRA tenant owning rows, in its backward, of
``P c r_max`` elements (``r_max``: the largest rank among the call's LoRA and DoRA adapters), in the activations'
dtype. A fused projection (``qkv_proj``) is one call, so one collective.

The dropout keep-mask ``M`` is kept whole, or where memory binds not saved (``mask_memory.py``,
``dropout.MaskReplay``): the backward draws it again, whole, from the generator state the forward drew it from.
Either way ``dX`` applies it on every row, and ``Xd[R_j]`` is recomputed from the saved ``X[R_j]`` and its rows
``M[R_j]``. So the TP ranks of a stage must draw the same mask: they must share their micro-batch seed
(``window.microbatch_seed``), and then their generator states, hence their masks, agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from lorafleet.executor.torch.routing import LoraRouting


@dataclass(frozen=True, slots=True)
class TokenSplit:
    """The TP group of a column-parallel layer, as its LoRA operator splits the saved input's rows (``tp.py`` sets
    one on every column-parallel ``MultiLoraLinear`` of a TP > 1 replica)."""

    rank: int
    size: int
    group: dist.ProcessGroup

    def bounds(self, total: int) -> tuple[int, int]:
        """This rank's rows ``[first, end)`` of ``total``: ``ceil(total / size)`` a rank, the last ones fewer."""
        share = -(-total // self.size)
        first = min(self.rank * share, total)
        return first, min(first + share, total)

    def rows_of(self, x: Tensor, x2: Tensor) -> Tensor:
        """This rank's rows of ``x2 (T, K)`` (the flattened ``x``), a detached copy: a view would keep all of ``x``
        alive. One copy per input tensor ``x``, whichever projection asks first: q, k and v (gate and up) get the
        same ``x`` one after another, and save the same copy. It is kept on ``x`` itself (:data:`ROWS_ATTR`), so it
        lives no longer than ``x`` or the operators that saved it."""
        first, end = self.bounds(x2.shape[0])
        key = (self.rank, self.size, first, end, x._version)
        cached = getattr(x, ROWS_ATTR, None)
        if cached is not None and cached[0] == key:
            return cached[1]
        rows = x2.detach()[first:end].clone()
        setattr(x, ROWS_ATTR, (key, rows))
        return rows

    def buffer(self, total: int, width: int, like: Tensor) -> Tensor:
        """A zeroed ``(size ceil(total / size), width)`` buffer for ``dS'``: its first ``total`` rows are the call's
        rows (padding rows stay zero), the whole is what :meth:`reduce` scatters."""
        return like.new_zeros((self.size * -(-total // self.size), width))

    def reduce(self, buffer: Tensor, total: int) -> Tensor:
        """``Σ_i buffer_i`` over the group, this rank's rows only ``(end - first, width)``: one reduce-scatter."""
        out = buffer.new_empty((buffer.shape[0] // self.size, buffer.shape[1]))
        dist.reduce_scatter_single(out, buffer, group=self.group)
        first, end = self.bounds(total)
        return out[: end - first]


ROWS_ATTR = "_lorafleet_token_rows"
"""The attribute of a layer input holding ``(key, this rank's rows)`` (:meth:`TokenSplit.rows_of`); the key (the
split's rows and the input's version counter) makes an in-place change of the input a miss."""


@dataclass(frozen=True, slots=True)
class RowShare:
    """What one operator call's backward needs for ``dA`` on a TP rank (the module doc): its rows of the input and
    of the keep-mask, the routing restricted to them, and the split that sums ``dS'``."""

    split: TokenSplit
    total: int
    """``T``: the call's rows."""
    x: Tensor
    """``X[R_j]`` ``(end - first, K)``."""
    keep: Tensor | None
    """``M[R_j]`` (a view of the whole mask, kept or drawn again for this backward), or None without dropout."""
    routing: LoraRouting
    """The call's routing on ``R_j``, renumbered from row 0 (:func:`share_routing`)."""

    def buffer(self, width: int, like: Tensor) -> Tensor:
        """:meth:`TokenSplit.buffer` for this call."""
        return self.split.buffer(self.total, width, like)

    def reduce(self, buffer: Tensor) -> Tensor:
        """:meth:`TokenSplit.reduce` for this call: ``dS'[R_j]``."""
        return self.split.reduce(buffer, self.total)


@functools.lru_cache(maxsize=1024)
def share_routing(routing: LoraRouting, first: int, end: int) -> LoraRouting:
    """``routing`` on rows ``[first, end)``, renumbered from 0; cached (every layer of a micro-batch asks alike)."""
    return LoraRouting(routing.segments.within(first, end), routing.scalings, routing.dropouts)


def row_share(split: TokenSplit, x_rows: Tensor, total: int, keep: Tensor | None, routing: LoraRouting) -> RowShare:
    """The :class:`RowShare` of a call of ``total`` rows whose rank saved ``x_rows`` (:meth:`TokenSplit.rows_of`)."""
    first, end = split.bounds(total)
    return RowShare(split, total, x_rows, None if keep is None else keep[first:end], share_routing(routing, first, end))


def owners(routing: LoraRouting) -> set[int]:
    """The adapters that own rows in ``routing``."""
    return {a for a, length in zip(routing.segments.adapter_ids, routing.segments.lengths, strict=True) if length}


def zero_missing(dA: list[Tensor | None], lora_A: list[Tensor], routing: LoraRouting, like: Tensor) -> None:
    """Zeros for the adapters that own rows of the call but none of this rank's: every TP rank then returns a
    gradient for the same adapters (in ``like``'s dtype, as the computed ones)."""
    for a in owners(routing):
        if dA[a] is None:
            dA[a] = like.new_zeros(lora_A[a].shape)
