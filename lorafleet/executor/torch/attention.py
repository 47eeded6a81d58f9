"""Attention of packed micro-batches: causal attention inside each sequence only.

A packed micro-batch is one row of sequences laid end to end. A dense block-diagonal mask
over the row costs (Σ s_i)^2 per head; a variable-length kernel (FlashAttention's varlen,
which the cost model prices) costs Σ s_i^2. ``document_attention`` is that kernel for
every device: scaled-dot-product attention over each sequence's slice ``[a, b)`` of the
row, causal, and within the layer's sliding window where it has one (Mistral, Qwen2, Gemma, Phi-3)::

    out[a:b] = softmax(q[a:b] k[a:b]^T * scale + causal(/window) mask) v[a:b]

with the scores soft-capped, ``c tanh(scores / c)``, where the model asks (Gemma 2's ``attn_logit_softcapping``,
passed as ``softcap``): SDPA and FlashAttention's varlen kernel cannot, so such a layer takes
:func:`softcapped_attention` per document, the eager form transformers itself runs for Gemma 2.

On CUDA in fp16/bf16 (no attention dropout) the documents of every row go to FlashAttention's
variable-length kernel in one launch (``torch.nn.attention.varlen.varlen_attn``, where torch has
it); elsewhere SDPA runs once per document, a Python loop (the CPU path, and the reference the
GPU test compares the kernel with).

It is registered with transformers' ``AttentionInterface``; the executor's models use it
(``use_document_attention``) and pass ``document_bounds`` (and ``document_window``) through
the decoder layers' keyword arguments. A right-padded micro-batch passes ``[0, S]``: each row
is one document, causal, no mask (the padding follows the sequence, so causality alone hides
it). Without bounds it is transformers' own SDPA attention with the mask it is given (a
model called outside the executor).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lorafleet.executor.torch.transfer import to_device

try:  # FlashAttention's variable-length kernel (CUDA), in the form used here: windows and GQA
    from torch.nn.attention.varlen import varlen_attn

    if not {"window_size", "enable_gqa", "scale"} <= set(inspect.signature(varlen_attn).parameters):
        varlen_attn = None  # an earlier form of the API: the per-document loop instead
except ImportError:  # no varlen API in this torch: every device takes the per-document loop
    varlen_attn = None

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
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """query (B, heads, S, d), key/value (B, kv_heads, S, d) -> (B, S, heads, d).

    ``document_bounds`` = [0, s_1, s_1 + s_2, ..., S]: the sequences of the packed row, or
    [0, S] for right-padded rows. ``softcap``: the scores' soft cap c (module doc), or None.
    """
    if document_bounds is None:
        if softcap is not None:
            raise ValueError("soft-capped attention needs document_bounds (SDPA cannot soft-cap)")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if softcap is None and uses_varlen(query, dropout):
        return varlen_documents(query, key, value, tuple(document_bounds), document_window, scaling), None
    return per_document(query, key, value, document_bounds, document_window, dropout, scaling, softcap), None


def uses_varlen(query: Tensor, dropout: float) -> bool:
    """Whether FlashAttention's varlen kernel takes this call: CUDA, fp16/bf16, no dropout, torch has it."""
    return varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not dropout


def per_document(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bounds: Sequence[int],
    window: int | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """SDPA over each document's slice of the rows, one call per document (soft-capped: :func:`softcapped_attention`).
    ``key``/``value`` may have fewer heads than ``query`` (GQA: SDPA's ``enable_gqa`` shares each of them across its
    query heads without copying it ``heads / kv_heads`` times). Returns (B, S, heads, d).

    The documents are cut by one ``split`` per tensor, whose backward writes every document's gradient
    into one buffer; slicing each document out (``query[:, :, a:b]``) would give each slice's backward a
    zero-filled gradient of the whole row, summed per document: O(documents x S) memory traffic a layer.
    Each output is laid out (B, s, heads, d) and concatenated along the row, one copy.
    """
    gqa = key.shape[1] != query.shape[1]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if len(lengths) == 1:
        pieces = [(query, key, value)]
    else:
        pieces = list(zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True))
    outs = []
    for (q, k, v), n in zip(pieces, lengths, strict=True):
        if softcap is not None:
            mask = _window_mask(n, n if window is None else window, query.device)
            out = softcapped_attention(q, k, v, mask, scaling, softcap, dropout)
        elif window is None or n <= window:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:
            mask = _window_mask(n, window, query.device)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        outs.append(out.transpose(1, 2))  # (B, s, heads, d)
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs, dim=1)


def softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float | None, softcap: float, dropout: float = 0.0
) -> Tensor:
    """One document's attention with soft-capped scores, as transformers' eager attention computes it (Gemma 2)::

        out = softmax(c tanh(q k^T * scale / c) masked) v        (softmax in fp32)

    q (B, heads, n, d), k/v (B, kv_heads, n, d) (GQA: each key/value head repeated for its query heads, as
    transformers' ``repeat_kv``), ``mask`` (n, n) bool: which keys a query sees. Returns (B, heads, n, d).
    """
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


def varlen_documents(
    query: Tensor, key: Tensor, value: Tensor, bounds: tuple[int, ...], window: int | None, scaling: float | None = None
) -> Tensor:
    """Every document of every row in one FlashAttention varlen launch: the B rows laid end to end
    as (B S, heads, d), documents at :func:`_cumulative_starts`; causal, and a sliding window of
    ``window`` tokens (the query and the window - 1 before it, as :func:`_window_mask`) as
    FlashAttention's left window ``window - 1``. GQA is the kernel's own. Returns (B, S, heads, d)."""
    b, heads, s, d = query.shape
    starts, longest = _cumulative_starts(bounds, b, query.device)
    out = varlen_attn(
        query.transpose(1, 2).reshape(b * s, heads, d),
        key.transpose(1, 2).reshape(b * s, key.shape[1], d),
        value.transpose(1, 2).reshape(b * s, value.shape[1], d),
        starts,
        starts,
        longest,
        longest,
        scale=scaling,
        window_size=(-1, 0) if window is None else (window - 1, 0),
        enable_gqa=key.shape[1] != heads,
    )
    return out.view(b, s, heads, d)


@functools.lru_cache(maxsize=256)
def _cumulative_starts(bounds: tuple[int, ...], rows: int, device: torch.device) -> tuple[Tensor, int]:
    """The documents' starts in ``rows`` rows of ``bounds[-1]`` tokens laid end to end, and the end
    (int32, on ``device``), with the longest document. Cached: every layer of a micro-batch asks
    for the same."""
    width = bounds[-1]
    starts = [r * width + a for r in range(rows) for a in bounds[:-1]] + [rows * width]
    host = torch.tensor(starts, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    return to_device(host, device), longest


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)


def use_document_attention(model: nn.Module) -> None:
    """Make ``model`` (a transformers causal LM) attend with ``document_attention``."""
    model.config._attn_implementation = DOCUMENT_ATTENTION


def uses_document_attention(model: nn.Module) -> bool:
    return model.config._attn_implementation == DOCUMENT_ATTENTION
