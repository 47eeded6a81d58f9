"""A shared frozen base whose projections are stored quantized (QLoRA) and dequantized in the forward.

:func:`quantize_base` replaces every decoder projection (``specs.lora.LLAMA_TARGET_MODULES``: all the linear layers
of a block; the embedding and LM head stay, as bitsandbytes and QLoRA keep them) of a whole model by a
:class:`QuantizedLinear`: the weight stored in ``quant.py``'s NF4 or int8 (bitsandbytes' bytes), ``y = x W'^T + b``
with ``W'`` its dequantization in the compute dtype, as bitsandbytes' ``Linear4bit``/``Linear8bitLt`` compute on a GPU
(dequantize, then one GEMM). Every tenant's adapter wraps the one quantized layer (``MultiLoraLinear`` reads
:attr:`QuantizedLinear.weight`), and adapters stay fp32 masters over a 16-bit compute dtype.

Tensor parallelism slices the stored bytes, never re-quantizes (:meth:`QuantizedLinear.sliced`): a shard holds
exactly the whole model's values. NF4's blocks of 64 run along each row, so a shard is whole blocks when its rows'
lengths are multiples of 64 (refused otherwise); int8 keeps a scale per output row (a row-parallel shard keeps the
whole row's scale).

A reference on CPU, not a memory saving: ``W'`` of a layer lives from its forward to its backward, as the operator
saves it (bitsandbytes dequantizes again in the backward instead).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lorafleet.executor.torch.quant import (
    Int8Weight,
    Nf4Weight,
    dequantize_int8,
    dequantize_nf4,
    quantize_int8,
    quantize_nf4,
)
from lorafleet.specs.lora import FUSED_TARGET_MODULES, LLAMA_TARGET_MODULES, Quantization


class QuantizedLinear(nn.Module):
    """A frozen linear whose weight is stored in NF4 or int8 (buffers) and dequantized into ``dtype`` on use."""

    def __init__(self, stored: Nf4Weight | Int8Weight, bias: Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = Quantization.NF4 if isinstance(stored, Nf4Weight) else Quantization.INT8
        self.dtype = dtype
        """The compute dtype: the base's before quantization."""
        if isinstance(stored, Nf4Weight):
            self.out_features, self.in_features = stored.shape
            self.blocksize = stored.blocksize
            self.register_buffer("packed", stored.packed)
            self.register_buffer("scale", stored.absmax)
        else:
            self.out_features, self.in_features = stored.q.shape
            self.register_buffer("packed", stored.q)
            self.register_buffer("scale", stored.scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear, kind: Quantization) -> QuantizedLinear:
        """``linear``'s weight quantized (``quant.py``), its bias kept in its dtype."""
        return cls.of_tensors(linear.weight.detach(), linear.bias, kind)

    @classmethod
    def of_tensors(cls, weight: Tensor, bias: Tensor | None, kind: Quantization) -> QuantizedLinear:
        """A linear of ``weight (out, in)`` and ``bias`` with the weight quantized, computing in its dtype."""
        stored = quantize_nf4(weight) if kind is Quantization.NF4 else quantize_int8(weight)
        return cls(stored, bias, weight.dtype)

    @property
    def stored(self) -> Nf4Weight | Int8Weight:
        if self.kind is Quantization.NF4:
            return Nf4Weight(self.packed, self.scale, (self.out_features, self.in_features), self.blocksize)
        return Int8Weight(self.packed, self.scale)

    @property
    def weight(self) -> Tensor:
        """``W'`` ``(out, in)`` in the compute dtype, dequantized on every access."""
        stored = self.stored
        return (
            dequantize_nf4(stored, self.dtype) if isinstance(stored, Nf4Weight) else dequantize_int8(stored, self.dtype)
        )

    @property
    def frozen_key(self) -> Tensor:
        """A tensor that changes only when the stored weight does (``MultiLoraLinear`` caches ``||W'||²`` by it)."""
        return self.packed

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def sliced(self, dim: int, tp_rank: int, tp_size: int, keep_bias: bool) -> QuantizedLinear:
        """TP rank ``tp_rank``'s part: output rows (``dim`` 0) or input columns (``dim`` 1), cut from the stored
        bytes."""
        n, k = self.out_features, self.in_features
        size = (n if dim == 0 else k) // tp_size
        lo, hi = tp_rank * size, (tp_rank + 1) * size
        bias = None
        if self.bias is not None and keep_bias:
            bias = self.bias[lo:hi] if dim == 0 else self.bias
        if self.kind is Quantization.INT8:
            q = self.packed[lo:hi] if dim == 0 else self.packed[:, lo:hi]
            scale = self.scale[lo:hi] if dim == 0 else self.scale
            return QuantizedLinear(Int8Weight(q.clone(), scale.clone()), bias, self.dtype)
        if k % self.blocksize or (dim == 1 and size % self.blocksize):
            raise ValueError(
                f"NF4 blocks of {self.blocksize} do not split a ({n}, {k}) weight over {tp_size} TP ranks "
                f"along dim {dim}"
            )
        rows = self.packed.view(n, k // 2)  # two 4-bit values a byte, row-major
        scales = self.scale.view(n, k // self.blocksize)
        if dim == 0:
            packed, absmax = rows[lo:hi], scales[lo:hi]
        else:
            packed, absmax = rows[:, lo // 2 : hi // 2], scales[:, lo // self.blocksize : hi // self.blocksize]
        shape = (n, size) if dim == 1 else (size, k)
        stored = Nf4Weight(packed.reshape(-1, 1).clone(), absmax.reshape(-1).clone(), shape, self.blocksize)
        return QuantizedLinear(stored, bias, self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind.value}, {self.dtype}"


def quantize_base(model: nn.Module, kind: Quantization) -> list[str]:
    """Replaces every decoder projection of a whole (not yet injected or split) model by its :class:`QuantizedLinear`,
    in place; returns their names."""
    check_unfused_model(model)
    names = []
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] in LLAMA_TARGET_MODULES and isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, QuantizedLinear.of(module, kind))
            names.append(name)
    if not names:
        raise ValueError(f"{type(model).__name__} has no projection to quantize")
    return names


def check_unfused_model(model: nn.Module) -> None:
    """ValueError when ``model`` has a fused projection (Phi-3's): a quantized base of those is not built
    (``runtime.base_quantization.check_unfused`` refuses such a workload before any worker starts)."""
    fused = [name for name, _ in model.named_modules() if name.rpartition(".")[2] in FUSED_TARGET_MODULES]
    if fused:
        raise ValueError(f"{fused[0]} is a fused projection: a quantized base of fused projections is not built")


def dequantized_copy(model: nn.Module, kind: Quantization) -> nn.Module:
    """``model`` with every projection's weight replaced by its dequantization (plain ``nn.Linear`` s): the function
    a quantized base computes, for a reference (PEFT) to train over. Changes ``model`` in place and returns it."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LLAMA_TARGET_MODULES and isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(QuantizedLinear.of(module, kind).weight)
    return model
