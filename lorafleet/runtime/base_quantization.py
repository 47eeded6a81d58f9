"""What a run records of the quantized base its adapters learn over (QLoRA), and the checks and words built on it.

A checkpoint's manifest holds :data:`MANIFEST_KEY`: ``{"kind": "nf4", "compute_dtype": "bfloat16"}`` when the run
trains over a base whose projections are stored quantized (``executor/torch/quantized_base.py``), ``null`` when it
does not. An adapter learns the function of the base it was trained over, so from that record:

- a resume whose workload asks for another ``quantize`` is refused (:func:`check_resumed_quantize`), before any
  process starts: the adapters would go on learning over another function;
- an exported adapter's model card names the quantized base and how to load the same one
  (:meth:`QuantizedBase.card_line`, :meth:`QuantizedBase.load_lines`).

A manifest written before the key existed says nothing either way: no check, no line.

:func:`check_quantizable` refuses ``quantize`` over weights that are already quantized (a GGUF file), and
:func:`check_unfused` over a family whose projections are fused (Phi-3); the launcher's preflight runs both, so the run
stops in one line before any worker loads a model. :func:`check_base_choice` runs both over each quantized base of a
workload's ``quantize: auto`` or list, so a choice the model cannot take is refused, not planned around in silence.

Torch-free (``lorafleet.train`` imports it before any worker starts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.data.model_source import GGUF_PACKAGES, ModelSource, SourceKind, resolve_model_source
from lorafleet.errors import InputError
from lorafleet.specs.architecture import FUSING_MODEL_TYPES
from lorafleet.specs.lora import FUSED_TARGET_MODULES, Quantization

MANIFEST_KEY = "quantized_base"
"""A checkpoint manifest's record of the base's quantization (module doc)."""


@dataclass(frozen=True)
class QuantizedBase:
    """The quantized base a run trains over: its projections stored as ``kind``, dequantized into ``compute_dtype``
    (a torch dtype's name, ``bfloat16``) for each GEMM."""

    kind: Quantization
    compute_dtype: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind.value, "compute_dtype": self.compute_dtype}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> QuantizedBase:
        return cls(Quantization(raw["kind"]), str(raw["compute_dtype"]))

    def card_line(self) -> str:
        """The model card's line on the base (``bitsandbytes``' layout, which ``executor/torch/quant.py`` writes
        byte for byte)."""
        if self.kind is Quantization.NF4:
            how = (
                "NF4-quantized base (bitsandbytes' `quantize_4bit` layout: 4-bit NormalFloat in blocks of 64 values "
                "with an fp32 absmax each, no double quantization)"
            )
        else:
            how = (
                "int8-quantized base (bitsandbytes' `Int8Params` layout: row-wise int8 with an fp32 absmax a row, "
                "no outlier columns)"
            )
        caveat = (
            " (bitsandbytes' 8-bit matmul also quantizes the activations: close to that function, not exactly it)"
            if self.kind is Quantization.INT8
            else ""
        )
        return (
            f"- Quantized base: trained over an {how}, every decoder projection dequantized to {self.compute_dtype} "
            "for its GEMM; the embeddings, norms and LM head unquantized. Load the base quantized the same way "
            f"(below) for the function the adapter learnt over{caveat}"
        )

    def load_lines(self) -> tuple[list[str], str]:
        """The card's usage block's imports and the statement that makes ``quantization``, the config that loads the
        base as it was trained over."""
        if self.kind is Quantization.NF4:
            config = (
                'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False, '
                f"bnb_4bit_compute_dtype=torch.{self.compute_dtype})"
            )
            return ["import torch", "from transformers import BitsAndBytesConfig"], f"quantization = {config}"
        return ["from transformers import BitsAndBytesConfig"], "quantization = BitsAndBytesConfig(load_in_8bit=True)"


def recorded_base(manifest: Mapping[str, Any]) -> QuantizedBase | None:
    """A manifest's quantized base; None for an unquantized one, or a manifest that does not say (module doc)."""
    raw = manifest.get(MANIFEST_KEY)
    return None if raw is None else QuantizedBase.from_json(raw)


def check_resumed_quantize(
    step_dir: Path, manifest: Mapping[str, Any], quantize: Quantization | None, path: str, plan: str | None = None
) -> None:
    """InputError (``path``: the workload; field ``quantize``) when the checkpoint of ``step_dir`` (its
    ``manifest``) was trained over another base than the one ``quantize`` asks for: the resumed adapters would
    learn on over another function. With ``plan``, ``quantize`` is that plan's base, which a workload that lets the
    planner choose (``quantize: auto`` or a list) takes: the error names the plan's field and the plan as the fix.
    Nothing when the manifest does not say."""
    if MANIFEST_KEY not in manifest:
        return
    recorded = recorded_base(manifest)
    before = recorded.kind if recorded is not None else None
    if before == quantize:
        return
    words = {None: "an unquantized base", Quantization.NF4: "an NF4 base", Quantization.INT8: "an int8 base"}
    was = before.value if before is not None else "null"
    trained = f"the checkpoint {step_dir} was trained over {words[before]}, and a resume cannot change the base its "
    now = quantize.value if quantize is not None else "null"
    if plan is not None:
        raise InputError(
            plan,
            "pools[0].cost_model.quantize",
            f"{now}: {trained}adapters learn over; the workload chooses its base by its plan: resume with the plan "
            f"the run trained by (one priced over quantize: {was}), or start a new run",
        )
    raise InputError(
        path, "quantize", f"{now}: {trained}adapters learn over (resume with quantize: {was}, or start a new run)"
    )


def check_quantizable(source: ModelSource, kind: Quantization | None, where: str = "workload") -> None:
    """InputError when ``kind`` asks to quantize a base whose weights are already quantized: a GGUF file (dequantized
    on load, so quantizing it again compounds two roundings)."""
    if kind is not None and source.kind is SourceKind.GGUF:
        raise InputError(
            where,
            "quantize",
            f"{kind.value}: {source.name!r} is a GGUF file, whose weights are already quantized (dequantized on load); "
            "quantize the original weights instead",
        )


def check_unfused(model_type: str, kind: Quantization | None, where: str = "workload") -> None:
    """InputError when ``kind`` asks to quantize a family whose projections are fused (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``): a quantized fused projection, which TP cuts part by part, is not built."""
    if kind is not None and model_type in FUSING_MODEL_TYPES:
        raise InputError(
            where,
            "quantize",
            f"{kind.value}: {model_type} fuses its projections ({', '.join(FUSED_TARGET_MODULES)}), and a quantized "
            "base of fused projections is not built; train it unquantized",
        )


def check_base_choice(model: str, model_type: str, bases: Sequence[Quantization | None], where: str) -> None:
    """InputError (``where``, field ``quantize``) when a quantized base among ``bases`` (a workload's ``quantize: auto``
    or list) cannot be built for ``model`` (:func:`check_unfused`, :func:`check_quantizable`). A model whose weights
    are not on this machine (a preset planned without them) is judged by its family alone; its GGUF-ness is known
    only from its name (a GGUF preset) until ``train`` resolves the weights."""
    quantized = [b for b in bases if b is not None]
    if not quantized:
        return
    written = ", ".join("none" if b is None else b.value for b in bases)
    try:
        source = resolve_model_source(model, source=where, field="model")
    except InputError:
        source = ModelSource(kind=SourceKind.GGUF, name=model) if model in GGUF_PACKAGES else None
    for kind in quantized:
        try:
            check_unfused(model_type, kind, where)
            if source is not None:
                check_quantizable(source, kind, where)
        except InputError as err:
            raise InputError(where, "quantize", f"[{written}] includes {err.msg}") from None
