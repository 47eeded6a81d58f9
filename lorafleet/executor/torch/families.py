"""What the executor's stage forward does differently by model family (``specs.architecture``).

``step.stage_forward`` runs a stage's parts of a transformers causal LM itself (embedding, rotary tables, decoder
layers, final norm, LM head), so what the model's own ``forward`` adds around its layers is applied here:

- **rotary tables**: one for every layer (Llama, Qwen, Mistral, Gemma 2, Phi-3), or one per layer type (Gemma 3: its
  sliding-window layers use a local base frequency, its global ones another), :func:`rotary_tables`;
- **final logit soft-capping** (Gemma 2): ``logits = c tanh(logits / c)``, :func:`final_logits`.

Everything else a family adds lives inside its modules and needs nothing here: Gemma's ``sqrt(hidden)`` embedding
scale is its embedding module's, its ``1 + w`` RMS norms and pre/post feed-forward norms its decoder layer's, GELU
(tanh) its MLP's; Qwen3's and Gemma 3's query/key norms (per head, so TP leaves them whole) its attention's; Gemma 2's
attention soft-capping is passed to the attention function (``attention.document_attention``'s ``softcap``); a
sliding window is read per layer from the config (``step.attention_window``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

RotaryTable = tuple[Tensor, Tensor]
"""``(cos, sin)``, each ``(B, S, head_dim)``."""

EAGER_ATTENTION_TYPES = ("gemma2",)
"""Families that transformers will not build with SDPA attention (Gemma 2: SDPA cannot soft-cap); they are built
with eager attention, which the executor then replaces by ``document_attention`` as for every family."""


def base_attention(model_type: str) -> str:
    """The ``attn_implementation`` a base model of ``model_type`` is built with: SDPA (no ``(B, H, S, S)`` weights
    kept), or eager where transformers refuses SDPA (:data:`EAGER_ATTENTION_TYPES`)."""
    return "eager" if model_type in EAGER_ATTENTION_TYPES else "sdpa"


def rotary_tables(model: nn.Module, hidden: Tensor, position_ids: Tensor) -> Callable[[int], RotaryTable]:
    """The rotary table of each decoder layer, by the layer's index, computed once per micro-batch and stage.

    Gemma 3's rotary embedding takes the layer type (``config.layer_types[i]``); every other family's has one table
    for all layers.
    """
    rotary = model.model.rotary_emb
    kinds = getattr(rotary, "layer_types", None)  # Gemma 3's: the layer types it holds a table for
    if kinds is None:
        table = rotary(hidden, position_ids)
        return lambda index: table
    tables = {kind: rotary(hidden, position_ids, kind) for kind in kinds}
    layer_types = model.config.layer_types
    return lambda index: tables[layer_types[index]]


def final_logits(model: nn.Module, logits: Tensor) -> Tensor:
    """The LM head's output as the model's own forward returns it: soft-capped, ``c tanh(logits / c)``, where the
    config sets ``final_logit_softcapping = c`` (Gemma 2), else as it is."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap
