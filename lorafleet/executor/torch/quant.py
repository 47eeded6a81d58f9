"""Reference 4- and 8-bit storage of a frozen base weight, in torch, bit-identical to bitsandbytes' own.

QLoRA keeps the shared base quantized and dequantizes it in the forward; bitsandbytes does that on a GPU. This module
is the same quantization written in torch, for a CPU (or a machine without bitsandbytes), checked bit for bit against
the bytes bitsandbytes 0.50.2 writes for the same weights (``tests/executor/torch/test_quant.py``, its golden file
made by ``scripts/quant_golden.py`` where bitsandbytes imports).

**NF4** (Dettmers et al., 2023; ``bitsandbytes.functional.quantize_4bit(w, blocksize, quant_type="nf4")``, without
double quantization). The flattened weight is cut into blocks of ``B`` (64) values; block ``j`` keeps
``absmax_j = max |w|`` (fp32) and each value its index in the 16-entry NormalFloat code ``c`` (:data:`NF4_CODE`,
quantiles of N(0, 1) scaled to [-1, 1]):

    q_i = argmin_k |c_k - w_i / absmax_j|    (bucketize against the midpoints of c, ties to the lower entry)
    w'_i = c[q_i] * absmax_j                 (the dequantized weight, fp32, then the compute dtype)

two indices a byte, the even one in the high nibble: 0.5 bytes a weight and 4 / B for the scale (0.5625 at B = 64).

**int8** (LLM.int8's weight storage, ``bnb.nn.Int8Params``: ``int8_vectorwise_quant`` of the weight cast to fp16,
without outlier columns): each output row keeps ``s_n = max |w_n|`` (fp32) and
``q = round(w * 127 / s_n)`` (int8); ``w' = q * s_n / 127`` (bitsandbytes multiplies by the reciprocal,
``7.874015718698502e-3``): 1 byte a weight and 4 a row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The NormalFloat-4 code (bitsandbytes' ``get_4bit_type("nf4")``), ascending."""

NF4_BLOCKSIZE = 64
"""Values per NF4 scale (bitsandbytes' and QLoRA's default)."""

INT8_RECIPROCAL = 7.874015718698502e-3
"""``1 / 127`` as bitsandbytes' int8 dequantization multiplies by it."""


@functools.lru_cache(maxsize=8)
def _nf4_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """(the code, the midpoints between its consecutive entries), fp32 on ``device``."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    return code, (code[:-1] + code[1:]) / 2


@dataclass(frozen=True)
class Nf4Weight:
    """A weight in NF4: ``packed`` ``(ceil(n / 2), 1)`` uint8 (bitsandbytes' layout), ``absmax`` fp32 per block."""

    packed: Tensor
    absmax: Tensor
    shape: tuple[int, ...]
    blocksize: int = NF4_BLOCKSIZE

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.absmax.numel() * self.absmax.element_size()


def quantize_nf4(weight: Tensor, blocksize: int = NF4_BLOCKSIZE) -> Nf4Weight:
    """``weight`` in NF4 (module doc), the bytes ``bitsandbytes.functional.quantize_4bit`` writes on a CPU."""
    code, midpoints = _nf4_tables(weight.device)
    flat = weight.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if n % blocksize:
        tail = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / tail, -1, 1)])
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    index = torch.bucketize(scaled, midpoints, out_int32=True).to(torch.uint8)
    packed = ((index[::2] << 4) | index[1::2]).unsqueeze(1)
    return Nf4Weight(packed, absmax, tuple(weight.shape), blocksize)


def dequantize_nf4(weight: Nf4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """``w' = c[q] * absmax`` in ``dtype`` (computed in fp32, as bitsandbytes does)."""
    code, _ = _nf4_tables(weight.packed.device)
    packed = weight.packed.reshape(-1)
    index = torch.empty(packed.numel() * 2, dtype=torch.int32, device=packed.device)
    index[0::2], index[1::2] = packed >> 4, packed & 0xF
    n = 1
    for size in weight.shape:
        n *= size
    values = code[index][:n]
    full = n - n % weight.blocksize
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    out[:full] = (
        values[:full].view(-1, weight.blocksize) * weight.absmax[: full // weight.blocksize].view(-1, 1)
    ).view(-1)
    if full < n:
        out[full:] = values[full:] * weight.absmax[-1]
    return out.view(weight.shape).to(dtype)


@dataclass(frozen=True)
class Int8Weight:
    """A weight in int8: ``q`` ``(N, K)`` int8 and ``scale`` ``(N,)`` fp32 row absmax (bitsandbytes' CB and SCB)."""

    q: Tensor
    scale: Tensor

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


def quantize_int8(weight: Tensor) -> Int8Weight:
    """``weight (N, K)`` row-wise in int8 (module doc), the ``CB, SCB`` of bitsandbytes' ``Int8Params``."""
    half = weight.contiguous().to(torch.float16)
    scale = torch.max(half.abs(), dim=1).values.float()
    return Int8Weight(torch.round(half * (127.0 / scale.unsqueeze(-1))).to(torch.int8), scale)


def dequantize_int8(weight: Int8Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """``w' = q * s / 127`` in ``dtype`` (as bitsandbytes' ``int8_vectorwise_dequant``)."""
    return (weight.q * weight.scale.view(-1, 1) * INT8_RECIPROCAL).to(dtype)
