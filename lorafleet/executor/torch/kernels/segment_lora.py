"""Segmented LoRA GEMMs in Triton: the CUDA backend of ``multi_lora.multi_lora_linear``.

Adapter weights are stacked and zero-padded to the largest rank ``R``: ``A (n, R, K)`` and
``B (n, N, R)``. A program finds its adapter's weights at ``w_ptr + adapter * stride_wa``, never
through a table of pointers: Triton's interpreter (``TRITON_INTERPRET=1``, how these kernels are
tested on CPU) cannot load a pointer from memory, and one base pointer plus an offset is as fast.
Padding columns of ``S`` and rows of ``dA`` are exact zeros, so ranks may differ per adapter.

Three kernels cover forward and backward (math in ``multi_lora``'s module doc):

* ``_shrink_kernel``  ``out[m, r] = c_a Σ_k x'[m, k] w[a, r, k]``
  forward ``S = Xd A^T`` (x' = dropout(X)), backward ``dS = s G B`` (w = B read transposed).
* ``_expand_kernel``  ``out[m, n] += c_a Σ_r s[m, r] w[a, r, n]`` (⊙ keep / (1-p) if masked)
  forward ``Y += s S B^T`` into the base output, backward ``dX += (dS A) ⊙ M / (1-p)``
  into the ``G W`` buffer: the input gradient is written once, in place.
* ``_weight_grad_kernel``  ``out[a, i, j] = c_a Σ_{m in a's rows} left[m, i] right'[m, j]``
  ``dA = dS^T Xd`` and ``dB = s G^T S``, reductions over an adapter's tokens.

Row-major operands (``x``, ``S``, ``G``, ``dX``, ``keep``) are contiguous ``(T, C)``; weights
take explicit strides so one kernel reads ``A`` or ``B`` either way round. Accumulation is fp32.
One fixed tile rule per kernel (no autotuning: under the interpreter every extra
config is a full extra run, and benchmarking needs a GPU driver).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.nn import functional as F

from lorafleet.executor.torch.kernels.stacking import stack_padded
from lorafleet.executor.torch.routing import LoraRouting
from lorafleet.executor.torch.transfer import to_device

BLOCK_M = 64
"""Rows per tile: tokens of one segment (also the token chunk of the weight-gradient reduction)."""
BLOCK_N = 64
"""Largest tile over a feature or rank dimension; smaller dimensions get the next power of two."""


def _tile(n: int) -> int:
    """Tile size for a dimension of size n: a power of two in [16, BLOCK_N] (tl.dot needs >= 16)."""
    return min(BLOCK_N, max(16, triton.next_power_of_2(n)))


@triton.jit
def _segment(seg_ptr, n_segments, seg):
    """(start, length, adapter) of segment ``seg`` from the packed int32 table (3, n_segments)."""
    start = tl.load(seg_ptr + seg)
    length = tl.load(seg_ptr + n_segments + seg)
    adapter = tl.load(seg_ptr + 2 * n_segments + seg)
    return start, length, adapter


@triton.jit
def _shrink_kernel(
    x_ptr, w_ptr, out_ptr, keep_ptr, seg_ptr, scale_ptr, inv_keep_ptr,
    n_segments, K, R,
    stride_wa, stride_wr, stride_wk,
    HAS_KEEP: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (row tiles, rank tiles, segments). ``out (T, R) = c_a · x'(T, K) · w[a]^T`` on the segment's rows."""
    start, length, adapter = _segment(seg_ptr, n_segments, tl.program_id(2))
    first = tl.program_id(0) * BLOCK_M
    if first >= length:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    row_ok = offs_m < length
    rows = (start + offs_m).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + adapter.to(tl.int64) * stride_wa
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x_mask = row_ok[:, None] & (ks[None, :] < K)
        x_offs = rows[:, None] * K + ks[None, :]
        xt = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)  # (BLOCK_M, BLOCK_K)
        if HAS_KEEP:
            kt = tl.load(keep_ptr + x_offs, mask=x_mask, other=0)
            xt = tl.where(kt != 0, xt * tl.load(inv_keep_ptr + adapter), 0.0).to(xt.dtype)
        w_mask = (offs_r[None, :] < R) & (ks[:, None] < K)
        wt = tl.load(
            w_base + offs_r[None, :] * stride_wr + ks[:, None] * stride_wk, mask=w_mask, other=0.0
        )  # (BLOCK_K, BLOCK_R)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + adapter)
    out_mask = row_ok[:, None] & (offs_r[None, :] < R)
    tl.store(out_ptr + rows[:, None] * R + offs_r[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _expand_kernel(
    s_ptr, w_ptr, out_ptr, keep_ptr, seg_ptr, scale_ptr, inv_keep_ptr,
    n_segments, N, R,
    stride_wa, stride_wr, stride_wn,
    HAS_KEEP: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Grid (row tiles, column tiles, segments). ``out (T, N) += c_a · s(T, R) · w[a] [⊙ keep/(1-p_a)]``."""
    start, length, adapter = _segment(seg_ptr, n_segments, tl.program_id(2))
    first = tl.program_id(0) * BLOCK_M
    if first >= length:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    row_ok = offs_m < length
    rows = (start + offs_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    w_base = w_ptr + adapter.to(tl.int64) * stride_wa
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):  # one iteration for ranks up to BLOCK_R
        rs = r0 + offs_r
        st = tl.load(s_ptr + rows[:, None] * R + rs[None, :], mask=row_ok[:, None] & (rs[None, :] < R), other=0.0)
        w_mask = (rs[:, None] < R) & (offs_n[None, :] < N)
        wt = tl.load(w_base + rs[:, None] * stride_wr + offs_n[None, :] * stride_wn, mask=w_mask, other=0.0)
        acc = tl.dot(st, wt, acc, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + adapter)
    out_mask = row_ok[:, None] & (offs_n[None, :] < N)
    out_offs = rows[:, None] * N + offs_n[None, :]
    if HAS_KEEP:
        kt = tl.load(keep_ptr + out_offs, mask=out_mask, other=0)
        acc = tl.where(kt != 0, acc * tl.load(inv_keep_ptr + adapter), 0.0)
    acc += tl.load(out_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _weight_grad_kernel(
    left_ptr, right_ptr, out_ptr, keep_ptr, seg_ptr, group_ptr, scale_ptr, inv_keep_ptr,
    n_segments, n_adapters, I, J,  # noqa: E741 (the I x J gradient, as in the docstring)
    HAS_KEEP: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Grid (I tiles, J tiles, adapters). ``out[a] (I, J) = c_a Σ_m left[m]^T right'[m]`` over a's rows.

    ``group_ptr`` holds CSR offsets ``(n_adapters + 1)`` then the segment ids sorted by adapter,
    so each program reduces all of its adapter's segments itself: no atomics, and the sum is
    deterministic.
    """
    adapter = tl.program_id(2)
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for g in range(tl.load(group_ptr + adapter), tl.load(group_ptr + adapter + 1)):
        start, length, _ = _segment(seg_ptr, n_segments, tl.load(group_ptr + n_adapters + 1 + g))
        for m0 in range(0, length, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows = (start + offs_m).to(tl.int64)
            row_ok = offs_m < length
            l_mask = row_ok[None, :] & (offs_i[:, None] < I)
            lt = tl.load(left_ptr + rows[None, :] * I + offs_i[:, None], mask=l_mask, other=0.0)  # (BLOCK_I, BLOCK_M)
            r_mask = row_ok[:, None] & (offs_j[None, :] < J)
            r_offs = rows[:, None] * J + offs_j[None, :]
            rt = tl.load(right_ptr + r_offs, mask=r_mask, other=0.0)  # (BLOCK_M, BLOCK_J)
            if HAS_KEEP:
                kt = tl.load(keep_ptr + r_offs, mask=r_mask, other=0)
                rt = tl.where(kt != 0, rt * tl.load(inv_keep_ptr + adapter), 0.0).to(lt.dtype)
            acc = tl.dot(lt, rt, acc, input_precision=PRECISION)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + adapter)
    out_mask = (offs_i[:, None] < I) & (offs_j[None, :] < J)
    out_offs = adapter.to(tl.int64) * I * J + offs_i[:, None] * J + offs_j[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@functools.lru_cache(maxsize=256)
def _tables(routing: LoraRouting, device: torch.device) -> tuple[Tensor, Tensor]:
    """The routing's int32 table ``[starts | lengths | adapter ids | CSR offsets | segments by
    adapter]`` and float32 table ``[scalings | 1 / (1 - p)]`` on ``device``.

    Cached: every injected layer of a micro-batch has the same routing (``multi_lora`` caches
    the routing objects too), so the copy happens once a micro-batch, not once a layer call,
    and it does not stall the host (:func:`~lorafleet.executor.torch.transfer.to_device`).
    """
    segs = routing.segments
    n = len(routing.scalings)
    by_adapter = sorted(range(len(segs)), key=lambda j: segs.adapter_ids[j])
    offsets = [0] * (n + 1)
    for a in segs.adapter_ids:
        offsets[a + 1] += 1
    for a in range(n):
        offsets[a + 1] += offsets[a]
    ints = torch.tensor([*segs.starts, *segs.lengths, *segs.adapter_ids, *offsets, *by_adapter], dtype=torch.int32)
    floats = torch.tensor([*routing.scalings, *(1.0 / (1.0 - p) for p in routing.dropouts)], dtype=torch.float32)
    return to_device(ints, device), to_device(floats, device)


class _Launch:
    """Device-side tables and launch constants of one layer call, shared by all its kernels."""

    def __init__(self, routing: LoraRouting, rank: int, keep: Tensor | None, x: Tensor) -> None:
        segs = routing.segments
        n = len(routing.scalings)
        ints, floats = _tables(routing, x.device)
        self.n_segments, self.n_adapters, self.rank = len(segs), n, rank
        self.seg, self.group = ints[: 3 * len(segs)], ints[3 * len(segs) :]
        self.scale, self.inv_keep = floats[:n], floats[n:]
        self.keep = keep.view(torch.uint8) if keep is not None else None  # bool -> bytes, same storage
        self.row_tiles = triton.cdiv(max(segs.lengths), BLOCK_M)
        self.block_r = _tile(rank)
        # fp32 matmuls in torch are IEEE by default; TF32 would make the two backends disagree.
        self.precision = "ieee" if x.dtype == torch.float32 else "tf32"

    def shrink(
        self, x: Tensor, w: Tensor, w_strides: Sequence[int], out: Tensor, *, masked: bool, scaled: bool
    ) -> None:
        """``out (T, R) = c_a x'(T, C) w[a]^T`` per segment; ``w[a, r, k]`` at ``w_strides``."""
        n_cols = x.shape[1]
        _shrink_kernel[(self.row_tiles, triton.cdiv(self.rank, self.block_r), self.n_segments)](
            x, w, out, self.keep if masked else x, self.seg, self.scale, self.inv_keep,
            self.n_segments, n_cols, self.rank, *w_strides,
            HAS_KEEP=masked, HAS_SCALE=scaled, PRECISION=self.precision,
            BLOCK_M=BLOCK_M, BLOCK_R=self.block_r, BLOCK_K=_tile(n_cols),
        )  # fmt: skip

    def expand(
        self, s: Tensor, w: Tensor, w_strides: Sequence[int], out: Tensor, *, masked: bool, scaled: bool
    ) -> None:
        """``out (T, C) += c_a s(T, R) w[a]`` per segment (⊙ keep / (1-p)); ``w[a, r, n]`` at ``w_strides``."""
        n_cols = out.shape[1]
        _expand_kernel[(self.row_tiles, triton.cdiv(n_cols, BLOCK_N), self.n_segments)](
            s, w, out, self.keep if masked else s, self.seg, self.scale, self.inv_keep,
            self.n_segments, n_cols, self.rank, *w_strides,
            HAS_KEEP=masked, HAS_SCALE=scaled, PRECISION=self.precision,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=self.block_r,
        )  # fmt: skip

    def weight_grad(self, left: Tensor, right: Tensor, out: Tensor, *, masked: bool, scaled: bool) -> None:
        """``out[a] (I, J) = c_a Σ_{m in a} left[m, :I]^T right'[m, :J]``."""
        n_i, n_j = left.shape[1], right.shape[1]
        block_i, block_j = _tile(n_i), _tile(n_j)
        _weight_grad_kernel[(triton.cdiv(n_i, block_i), triton.cdiv(n_j, block_j), self.n_adapters)](
            left, right, out, self.keep if masked else right, self.seg, self.group, self.scale, self.inv_keep,
            self.n_segments, self.n_adapters, n_i, n_j,
            HAS_KEEP=masked, HAS_SCALE=scaled, PRECISION=self.precision,
            BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_M=BLOCK_M,
        )  # fmt: skip


def forward(x, weight, bias, lora_A, lora_B, routing: LoraRouting, keep):
    """Same contract as ``torch_lora.forward``; saves ``S`` and the stacked weights."""
    y = F.linear(x, weight, bias)  # (T, N): the one base GEMM (cuBLAS)
    if not any(routing.segments.lengths):
        return y, ()
    x = x.contiguous()
    rank = max(a.shape[0] for a in lora_A)
    A, B = stack_padded(lora_A, 0, x.dtype), stack_padded(lora_B, 1, x.dtype)  # (n, R, K), (n, N, R), R = rank
    launch = _Launch(routing, rank, keep, x)
    s = torch.empty((x.shape[0], rank), dtype=x.dtype, device=x.device)  # (T, R); padding rows never read
    launch.shrink(x, A, A.stride(), s, masked=keep is not None, scaled=False)  # S = Xd A^T
    launch.expand(s, B, (B.stride(0), B.stride(2), B.stride(1)), y, masked=False, scaled=True)  # Y += s S B^T
    return y, (s, A, B)


def backward(grad_y, x, weight, lora_A, lora_B, routing: LoraRouting, keep, saved, need_x, need_lora, share=None):
    """Same contract as ``torch_lora.backward``: with ``share`` (``x`` None) ``dS`` goes to the split's zero-padded
    buffer, and ``dA`` comes from its summed rows of this rank and the saved ``X`` rows, over the share's routing."""
    dx = grad_y.mm(weight) if need_x else None  # (T, K) = G W, the buffer dX is written into
    if not saved:
        return dx, [None] * len(lora_A), [None] * len(lora_B)
    s, A, B = saved
    grad_y = grad_y.contiguous()
    rank = A.shape[1]
    launch = _Launch(routing, rank, keep, grad_y)
    ds = share.buffer(rank, s) if share is not None and need_lora else torch.empty_like(s)  # (T, R), or padded
    launch.shrink(grad_y, B, (B.stride(0), B.stride(2), B.stride(1)), ds, masked=False, scaled=True)  # dS = s G B
    if need_x:
        launch.expand(ds, A, A.stride(), dx, masked=keep is not None, scaled=False)  # dX += (dS A) ⊙ M/(1-p)
    if not need_lora:
        return dx, [None] * len(lora_A), [None] * len(lora_B)
    dA = torch.empty_like(A)  # (n, R, K)
    dB = B.new_empty(B.shape)  # (n, N, R) contiguous (a mixed-rank B is a strided view)
    if share is None:
        launch.weight_grad(ds, x.contiguous(), dA, masked=keep is not None, scaled=False)  # dA = dS^T Xd
    elif share.routing.segments.lengths:  # dA_j = dS[R_j]^T Xd[R_j] on this rank's rows
        own = _Launch(share.routing, rank, share.keep, share.x)
        own.weight_grad(share.reduce(ds), share.x, dA, masked=share.keep is not None, scaled=False)
    else:  # no row here: the collective still runs (every rank of the group joins it), dA is zero
        share.reduce(ds)
        dA.zero_()
    launch.weight_grad(grad_y, s, dB, masked=False, scaled=True)  # dB = s G^T S
    owners = set(routing.segments.adapter_ids[j] for j, n in enumerate(routing.segments.lengths) if n)
    return (
        dx,
        [dA[a, : A_a.shape[0]] if a in owners else None for a, A_a in enumerate(lora_A)],  # (r_a, K)
        [dB[a, :, : B_a.shape[1]] if a in owners else None for a, B_a in enumerate(lora_B)],  # (N, r_a)
    )
