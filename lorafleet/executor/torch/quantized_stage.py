"""Loading a quantized shared base (QLoRA): whole, or per stage, each way to the same bytes.

:func:`load_quantized_base` chooses as ``base_model.load_base`` does. A source built whole (random weights, a GGUF, an
HF directory without safetensors) is quantized whole (``quantized_base.quantize_base``) and then TP-sliced and
PP-split by ``build_replica``. An HF directory with safetensors is loaded *per stage*: its skeleton goes through
injection, TP and the PP split on the meta device as an unquantized one does, and :func:`load_quantized_projections`
then gives each projection left in the stage the :class:`QuantizedLinear` the whole-model path holds there:

    W  = the projection's whole weight (N, K), read from the checkpoint in the compute dtype
    Q  = quantize(W)                    (quant.py: NF4 blocks of 64 along each row, or int8 with a scale a row)
    Qr = Q cut for TP rank r            (QuantizedLinear.sliced: the stored bytes, never re-quantized)

so a stage reads and quantizes only its own layers (PP), and each of its projections whole, not the TP slice: an
int8 row-parallel shard keeps the whole row's scale, which its columns alone cannot give. The rest of the stage
(embeddings, norms, the head) is read slice by slice by ``replica.load_stage``.
"""

from __future__ import annotations

import torch
from torch import nn

from lorafleet.data.model_source import ModelSource
from lorafleet.executor.torch.base_model import SafetensorsWeights, load_base
from lorafleet.executor.torch.inject import module_suffix
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.quantized_base import QuantizedLinear, check_unfused_model, quantize_base
from lorafleet.executor.torch.tp import TP_STYLES, sliced_linear
from lorafleet.runtime.layout import RankRole
from lorafleet.specs.lora import LLAMA_TARGET_MODULES, Quantization


class QuantizedWeights(SafetensorsWeights):
    """A checkpoint read per stage into a base whose projections are stored as :attr:`kind`
    (``replica.build_stage`` quantizes them with :func:`load_quantized_projections`)."""

    def __init__(self, weights: SafetensorsWeights, kind: Quantization) -> None:
        super().__init__(weights.directory, weights.entries)
        self.reads = weights.reads
        self.kind = kind


def load_quantized_base(
    source: ModelSource, dtype: torch.dtype, kind: Quantization
) -> tuple[nn.Module, QuantizedWeights | None]:
    """The base of ``source`` as ``build_replica`` takes it, its projections to be stored as ``kind``: the whole model
    quantized, or its skeleton and the checkpoint to load per stage (module doc)."""
    model, weights = load_base(source, dtype)
    check_unfused_model(model)
    if weights is None:
        quantize_base(model, kind)
        return model, None
    return model, QuantizedWeights(weights, kind)


def load_quantized_projections(
    model: nn.Module, weights: QuantizedWeights, role: RankRole, device: torch.device
) -> None:
    """Every decoder projection of a skeleton's stage (after TP and the PP split) replaced, in place, by its
    :class:`QuantizedLinear` as the whole-model path cuts it (module doc); an adapter's projection keeps its
    adapters, its ``base_layer`` replaced."""
    for name, module in list(model.named_modules()):
        suffix = module_suffix(name)
        if suffix not in LLAMA_TARGET_MODULES:
            continue
        linear = module.base_layer if isinstance(module, MultiLoraLinear) else module
        if not isinstance(linear, nn.Linear) or not linear.weight.is_meta:
            continue
        dtype = linear.weight.dtype
        whole = {key: _read_whole(weights, f"{name}.{key}", dtype, device) for key in ("weight", "bias")}
        quantized = QuantizedLinear.of_tensors(whole["weight"], whole["bias"], weights.kind)
        if role.replica.tp > 1:
            quantized = sliced_linear(quantized, TP_STYLES[suffix], role.tp_rank, role.replica.tp)
        if isinstance(module, MultiLoraLinear):
            module.base_layer = quantized
        else:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized)


def _read_whole(weights: QuantizedWeights, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The whole tensor ``name`` of the checkpoint in ``dtype`` on ``device``; None when the model has no such tensor
    (a projection without a bias)."""
    entry = weights.entries.get(name)
    if entry is None:
        return None
    return weights.read(name, tuple(slice(None) for _ in entry.shape), dtype, device)
