"""Attention of packed micro-batches: causal attention inside each sequence only.

A packed micro-batch is one row of sequences laid end to end. A dense block-diagonal mask
over the row costs (Σ s_i)^2 per head; a variable-length kernel (FlashAttention's varlen,
which the cost model prices) costs Σ s_i^2. ``document_attention`` is that kernel for
every device: scaled-dot-product attention over each sequence's slice ``[a, b)`` of the
row, causal, and within the layer's sliding window where it has one (Mistral, Qwen2)::

    out[a:b] = softmax(q[a:b] k[a:b]^T * scale + causal(/window) mask) v[a:b]

It is registered with transformers' ``AttentionInterface``; the executor's models use it
(``use_document_attention``) and pass ``document_bounds`` (and ``document_window``) through
the decoder layers' keyword arguments. A right-padded micro-batch passes ``[0, S]``: each row
is one document, causal, no mask (the padding follows the sequence, so causality alone hides
it). Without bounds it is transformers' own SDPA attention with the mask it is given (a
model called outside the executor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

DOCUMENT_ATTENTION = "lorafleet_documents"


def _window_mask(n: int, window: int, device: torch.device) -> Tensor:
    """(n, n) bool: token i attends to j iff i - window < j <= i."""
    i = torch.arange(n, device=device)
    gap = i[:, None] - i[None, :]
    return (gap >= 0) & (gap < window)


def document_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    document_bounds: Sequence[int] | None = None,
    document_window: int | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """query (B, heads, S, d), key/value (B, kv_heads, S, d) -> (B, S, heads, d).

    ``document_bounds`` = [0, s_1, s_1 + s_2, ..., S]: the sequences of the packed row, or
    [0, S] for right-padded rows.
    """
    if document_bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    outs = []
    for a, b in zip(document_bounds[:-1], document_bounds[1:]):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        if document_window is None or b - a <= document_window:
            outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling))
        else:
            mask = _window_mask(b - a, document_window, query.device)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)


def use_document_attention(model: nn.Module) -> None:
    """Make ``model`` (a transformers causal LM) attend with ``document_attention``."""
    model.config._attn_implementation = DOCUMENT_ATTENTION


def uses_document_attention(model: nn.Module) -> bool:
    return model.config._attn_implementation == DOCUMENT_ATTENTION
