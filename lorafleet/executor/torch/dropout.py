"""The dropout keep-mask ``M`` of one layer call: drawn in the forward, kept or drawn again in the backward.

In ``multi_lora``'s module doc it is the ``M_j`` of ``Xd_j = X[R_j] ⊙ M_j / (1 - p_a)``: a bool
``(T, K)`` mask, Bernoulli(1 - p_a) on adapter ``a``'s rows and all True elsewhere. The forward draws
it from the device's global generator (:func:`draw_keep_mask`). Where the memory model fits it
(``mask_memory.py``) the operator saves it for the backward; where memory binds the forward first takes
that generator's state (:meth:`MaskReplay.next_draw`), uses the mask and frees it, and the operator saves
only the :class:`MaskReplay`: the backward draws the same mask again from a private generator set to that
state (:meth:`MaskReplay.mask`), bit for bit, so ``dX`` and ``dA`` use exactly the forward's mask and no
``(T, K)`` byte is kept between the passes (as FlashAttention regenerates its dropout from the Philox
seed and offset), for one more draw. The global generator is read, never set: it leaves the forward as the
draw leaves it, so both paths draw the same masks.

Under tensor parallelism a column-parallel layer's input is whole on every TP rank, and each rank computes ``dA``
over its own rows of ``Xd`` (``token_split.py``): the ranks of a stage must draw the same mask, i.e. seed the global
RNG alike for a micro-batch. (A row-parallel rank draws a mask of its own ``(T, K / P)`` columns.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


def draw_keep_mask(
    rows: int,
    cols: int,
    routing: LoraRouting,
    *,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> Tensor | None:
    """The dropout keep-mask ``M (rows, cols)`` (bool): Bernoulli(1 - p_a) on adapter ``a``'s rows.

    Rows of adapters without dropout, and padding rows, are all True. Returns None when no
    non-empty segment has dropout, so the common p = 0 case allocates nothing. The mask is one
    byte per element, drawn from ``generator`` (default: the device's global one). It stands for
    each adapter's dropped input (what an ``nn.Dropout`` per adapter would keep alive: 4 bytes an
    element); the backward reads it, kept or drawn again (:class:`MaskReplay`), and recomputes ``Xd``.
    """
    spans = _dropout_spans(routing)
    return _draw(rows, cols, spans, torch.device(device), generator) if spans else None


def _draw(
    rows: int,
    cols: int,
    spans: tuple[tuple[int, int, float], ...],
    device: torch.device,
    generator: torch.Generator | None,
) -> Tensor:
    """:func:`draw_keep_mask` of a routing with dropout: its ``spans`` (:func:`_dropout_spans`) drawn in order."""
    keep = torch.empty((rows, cols), dtype=torch.bool, device=device)
    done = 0  # rows [0, done) are written
    for first, end, p in spans:
        if first > done:
            keep[done:first] = True
        _draw_keep_rows(keep[first:end], p, generator)
        done = end
    if rows > done:
        keep[done:] = True
    return keep


@functools.lru_cache(maxsize=1024)
def _dropout_spans(routing: LoraRouting) -> tuple[tuple[int, int, float], ...]:
    """``(first row, end row, p)`` of each span of consecutive non-empty segments sharing one
    p > 0: one Bernoulli draw per span (a packed batch with one dropout rate is one span).
    Padding rows inside a span are drawn too, harmlessly. Cached: every layer of a micro-batch
    asks alike, in the forward and again in the backward."""
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
    return tuple(spans)


def _draw_keep_rows(keep: Tensor, p: float, generator: torch.Generator | None) -> None:
    """Fills the contiguous bool rows ``keep`` with Bernoulli(1 - p) from ``generator`` (None: the global one).

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
        bits = words[: (count + 3) // 4].random_(-(2**63), None, generator=generator).view(torch.int16)[:count]
        torch.ge(bits, threshold, out=flat[first : first + count])


@dataclass(frozen=True, slots=True, eq=False)
class MaskReplay:
    """One call's keep-mask as what draws it: the shape, the routing and the state of the generator it is drawn
    from. :meth:`mask` draws it again, bit for bit: :func:`draw_keep_mask` is one stream of ``random_`` calls of
    fixed sizes in a fixed order, so a generator in the same state yields the same words (the CPU's Mersenne
    Twister fills in order; CUDA's Philox draws each call from the (seed, offset) of its state and advances the
    offset by an amount fixed by the call's size and the device: untested, no GPU here). ``state`` is
    ``Generator.get_state()``: 5,056 bytes on the host for the CPU generator, 16 for CUDA's (seed, offset), in
    place of the ``rows cols`` bytes of the mask."""

    rows: int
    cols: int
    routing: LoraRouting
    device: torch.device
    state: Tensor

    @classmethod
    def next_draw(cls, rows: int, cols: int, routing: LoraRouting, device: torch.device) -> MaskReplay | None:
        """The replay of the next :func:`draw_keep_mask` of these arguments from the device's global generator
        (which this only reads: call it right before that draw); None when that draw returns None (no dropout)."""
        if not _dropout_spans(routing):
            return None
        return cls(rows, cols, routing, device, default_generator(device).get_state())

    def mask(self) -> Tensor:
        """The keep-mask the forward drew, drawn again from a private generator set to :attr:`state` (the global
        generator is untouched: the backward of one micro-batch runs between the forwards of others)."""
        generator = torch.Generator(self.device)
        generator.set_state(self.state)
        return _draw(self.rows, self.cols, _dropout_spans(self.routing), self.device, generator)


def default_generator(device: torch.device) -> torch.Generator:
    """The global generator torch draws from on ``device`` (the CPU's ``torch.default_generator``, an
    accelerator's ``default_generators[index]``, the current device's without an index)."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device)
    return module.default_generators[module.current_device() if device.index is None else device.index]
