"""The dropout keep-mask ``M`` of one layer call, drawn in the forward.

In ``multi_lora``'s module doc it is the ``M_j`` of ``Xd_j = X[R_j] ⊙ M_j / (1 - p_a)``: a bool
``(T, K)`` mask, Bernoulli(1 - p_a) on adapter ``a``'s rows and all True elsewhere. It is drawn
once, here, from the global torch RNG; both backends save it and reapply it in the backward, so
``dX`` and ``dA`` use exactly the forward's mask.

Under tensor parallelism a column-parallel layer's input is whole on every TP rank, and each rank computes ``dA``
over its own rows of ``Xd`` (``token_split.py``): the ranks of a stage must draw the same mask, i.e. seed the global
RNG alike for a micro-batch. (A row-parallel rank draws a mask of its own ``(T, K / P)`` columns.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorafleet.executor.torch.routing import LoraRouting

_DRAW_CHUNK = 1 << 17
"""int64 random words per draw of :func:`_draw_keep_rows` (1 MiB): a speed constant only.

It trades the number of draws against the size of their one reused buffer: a buffer this
small is read back from cache by the compare that follows (on CPU measured ~10% cheaper than
8 MiB chunks, commit 8b8a99f), and a temporary the size of the whole mask would page-fault. The mask
does not depend on it: the CPU generator fills elements in order, so any chunk size draws the
same words in the same order and leaves the generator in the same state
(``test_keep_mask_is_one_random_stream_whatever_the_chunk``: chunks of 1, 3 and this).
"""


def draw_keep_mask(rows: int, cols: int, routing: LoraRouting, *, device: torch.device | str) -> Tensor | None:
    """The dropout keep-mask ``M (rows, cols)`` (bool): Bernoulli(1 - p_a) on adapter ``a``'s rows.

    Rows of adapters without dropout, and padding rows, are all True. Returns None when no
    non-empty segment has dropout, so the common p = 0 case allocates nothing. The mask is one
    byte per element. Both backends save it instead of each adapter's dropped input (what an
    ``nn.Dropout`` per adapter would keep alive: 4 bytes an element) and reapply it in the
    backward, which so uses exactly the forward's mask and recomputes ``Xd``.
    """
    spans = _dropout_spans(routing)
    if not spans:
        return None
    keep = torch.empty((rows, cols), dtype=torch.bool, device=device)
    done = 0  # rows [0, done) are written
    for first, end, p in spans:
        if first > done:
            keep[done:first] = True
        _draw_keep_rows(keep[first:end], p)
        done = end
    if rows > done:
        keep[done:] = True
    return keep


def _dropout_spans(routing: LoraRouting) -> list[tuple[int, int, float]]:
    """``(first row, end row, p)`` of each span of consecutive non-empty segments sharing one
    p > 0: one Bernoulli draw per span (a packed batch with one dropout rate is one span).
    Padding rows inside a span are drawn too, harmlessly."""
    spans: list[tuple[int, int, float]] = []
    previous_p = 0.0
    for a, start, length in routing.segments:
        if not length:
            continue
        p = routing.dropouts[a]
        if p and p == previous_p:
            spans[-1] = (spans[-1][0], start + length, p)
        elif p:
            spans.append((start, start + length, p))
        previous_p = p
    return spans


def _draw_keep_rows(keep: Tensor, p: float) -> None:
    """Fills the contiguous bool rows ``keep`` with Bernoulli(1 - p) from the global torch RNG.

    Bernoulli(1 - p) is ``u >= t`` on uniform 16-bit integers ``u``, ``t = -2^15 + round(p 2^16)``:
    P(drop) is ``round(p 2^16) / 2^16``, within 2^-17 of p (a float32 uniform, what
    ``nn.Dropout`` compares, resolves 2^-24; LoRA dropout rates are 0.05-0.1, and a p below
    2^-17 rounds to no dropout). The int16s are the raw bits of a quarter as many int64s drawn
    over the full range (``random_(-2^63, None)``: no modulo, so ~20% cheaper than naming the
    upper bound); measured on CPU, 16-bit draws cost ~60% of 32-bit ones, which cost ~80% of
    ``rand`` + compare (itself ~35% cheaper than ``bernoulli_``). They are drawn into one reused
    1 MiB buffer, not one temporary of the mask's size: on CPU a fresh multi-MiB temporary
    costs a page fault per 4 KiB. The CPU generator fills elements in order, so the chunks draw
    exactly the words one full-range ``random_`` over the whole span would.
    """
    flat = keep.view(-1)
    n = flat.numel()
    threshold = min(-(2**15) + round(p * 2**16), 2**15 - 1)
    words = torch.empty(min((n + 3) // 4, _DRAW_CHUNK), dtype=torch.int64, device=keep.device)
    for first in range(0, n, 4 * _DRAW_CHUNK):
        count = min(4 * _DRAW_CHUNK, n - first)  # int16s; a tail uses part of its last word
        bits = words[: (count + 3) // 4].random_(-(2**63), None).view(torch.int16)[:count]
        torch.ge(bits, threshold, out=flat[first : first + count])
