"""The model families lorafleet trains, by transformers' ``model_type``, and the projections a LoRA target names.

Every supported family is a decoder-only transformer whose blocks are attention (q, k, v, o projections) then a
gated MLP (gate, up, down): the executor shards them for TP and splits them for PP alike. What else differs
between the families, the executor's forward applies (``executor/torch/families.py``):

- ``llama``, ``mistral`` (a sliding window on every layer), ``qwen2`` (biased q/k/v);
- ``qwen3``: RMS norms of each head's query and key (``q_norm``, ``k_norm``, per head, so TP leaves them whole);
- ``gemma2`` and ``gemma3_text`` (Gemma 3's text-only model, 1B and 270M; the 4B-27B checkpoints are the
  multimodal ``gemma3``): RMS norms that scale by ``1 + w``, the embedding scaled by ``sqrt(hidden)``, norms before
  and after the MLP, GELU (tanh), sliding-window layers alternating with global ones (``layer_types``); Gemma 2
  soft-caps attention scores and final logits (``c tanh(x / c)``), Gemma 3 norms queries and keys and has one
  rotary table for its local layers and another for its global ones;
- ``phi3``: fused projections (below).

**Fused projections (Phi-3).** Phi-3 computes q, k and v with one linear, ``qkv_proj`` (its output rows are q's,
then k's, then v's), and gate and up with one, ``gate_up_proj`` (gate's rows, then up's). A LoRA adapter on a fused
projection is PEFT's: one ``A (r, in)`` and one ``B (out_q + out_k + out_v, r)``, so its ``adapter_config.json``
names ``qkv_proj`` and it loads in ``PeftModel.from_pretrained`` over the Phi-3 model as it is. A workload's target
list maps onto the model's projections (:func:`model_targets`): on Phi-3, ``q_proj, k_proj, v_proj`` together are
``qkv_proj`` and ``gate_proj, up_proj`` together are ``gate_up_proj`` (the default, every projection, is Phi-3's
every projection); a list naming some parts of a fused projection and not the others is refused, since the one
adapter on it would train them all. On the other families a fused name is refused: they have no such module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lorafleet.specs.lora import FUSED_TARGET_MODULES, LoraSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
"""The ``model_type`` values (a ``config.json`` field) whose models the executor trains, TP and PP included."""

FUSING_MODEL_TYPES = ("phi3",)
"""Families whose attention and MLP projections are fused (:data:`~lorafleet.specs.lora.FUSED_TARGET_MODULES`)."""

SLIDING, FULL = "sliding_attention", "full_attention"
"""The two values of a config's ``layer_types`` the families here use."""

_HINTS = {
    "gemma3": "the multimodal Gemma 3 checkpoint (4B-27B); its text-only model_type gemma3_text (Gemma 3 1B) is",
    "gemma": "Gemma 1; gemma2 and gemma3_text are",
    "phi": "Phi-1/2; phi3 (Phi-3, Phi-3.5, Phi-4) is",
}


def unsupported_model_type(model_type: object) -> str | None:
    """Why a model of ``model_type`` cannot be trained (one line), or None when it can."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    hint = _HINTS.get(str(model_type))
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if hint is not None:
        return f"model type {model_type!r} is not supported ({hint} supported; supported: {supported})"
    return f"model type {model_type!r} is not supported (supported: {supported})"


def model_targets(targets: Sequence[str], model_type: str) -> tuple[str, ...]:
    """The projections of a ``model_type`` model that a LoRA target list names, in the list's order (module doc).

    Raises:
        ValueError: the list names a fused projection on a family without one, or some parts of a fused
            projection and not the others (one line, naming them).
    """
    fuses = model_type in FUSING_MODEL_TYPES
    out: list[str] = []
    for target in targets:
        if target in FUSED_TARGET_MODULES:
            if not fuses:
                parts = ", ".join(FUSED_TARGET_MODULES[target])
                raise ValueError(f"{model_type} has no {target} (it has {parts}: name those)")
            module = target
        elif fuses:
            module = next((f for f, parts in FUSED_TARGET_MODULES.items() if target in parts), target)
        else:
            module = target
        if module != target:
            parts = FUSED_TARGET_MODULES[module]
            missing = [p for p in parts if p not in targets]
            if missing:
                raise ValueError(
                    f"{model_type} fuses {', '.join(parts)} into {module}, one adapter for all of them: name all of "
                    f"them or {module} (missing {', '.join(missing)})"
                )
        if module not in out:
            out.append(module)
    return tuple(out)


def model_lora(spec: LoraSpec, model_type: str) -> LoraSpec:
    """``spec`` with its targets as a ``model_type`` model names them (:func:`model_targets`): what the executor
    injects, trains and exports (a Phi-3 adapter's ``adapter_config.json`` names ``qkv_proj``)."""
    targets = model_targets(spec.target_modules, model_type)
    return spec if targets == spec.target_modules else spec.model_copy(update={"target_modules": targets})


def layer_window(window: int | None, layer_types: Sequence[str] | None, index: int) -> int | None:
    """The sliding window of decoder layer ``index``, or None for full causal attention: Qwen2, Qwen3, Gemma 2 and
    Gemma 3 name each layer's type in ``layer_types``; Mistral and Phi-3 apply ``window`` (when set) to every layer;
    Llama has none."""
    if layer_types:
        return window if layer_types[index] == SLIDING else None
    return window


def attention_layout(raw: Mapping[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` of a ``config.json``'s fields as transformers 5 reads them where the file
    leaves them out: Qwen2/Qwen3 have a window only with ``use_sliding_window``, on layers from
    ``max_window_layers`` on; Gemma 2 alternates (layer 0 windowed); Gemma 3 windows all but every
    ``sliding_window_pattern``-th layer (6); Mistral and Phi-3 give every layer the window (no layer types)."""
    model_type, n_layers = raw.get("model_type"), int(raw.get("num_hidden_layers") or 0)
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types")
    if types is None and model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", 28))
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n_layers)]
    elif types is None and model_type in ("gemma2", "gemma3_text"):
        every = 2 if model_type == "gemma2" else int(raw.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % every else FULL for i in range(n_layers)]
    return (None if window is None else int(window)), tuple(types or ())
