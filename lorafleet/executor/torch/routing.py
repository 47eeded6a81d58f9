"""Routing of one multi-LoRA layer call: which rows of ``X (T, K)`` use which adapter, how scaled.

Plain values, known on the host before the forward, that the operator (``multi_lora``) and both
backends (``kernels/torch_lora.py``, ``kernels/segment_lora.py``) read. In the terms of
``multi_lora``'s module doc: :class:`Segments` gives each segment ``j`` its rows
``R_j = [start_j, start_j + L_j)`` and adapter ``a_j``; :class:`LoraRouting` adds each adapter's
scaling ``s_a`` and dropout rate ``p_a``; :class:`LoraBackend` names the implementation of the
equations. No math happens here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class LoraBackend(StrEnum):
    """Which implementation computes the segmented low-rank GEMMs."""

    TORCH = "torch"
    """A loop over runs of segments with ``torch.bmm``; any device."""
    TRITON = "triton"
    """Segmented Triton kernels; CUDA, or CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""
    AUTO = "auto"
    """TRITON for CUDA tensors, TORCH otherwise."""


@dataclass(frozen=True, slots=True)
class Segments:
    """Which rows of a flattened ``(T, K)`` micro-batch go through which adapter.

    Segment ``j`` covers rows ``[starts[j], starts[j] + lengths[j])`` and uses adapter
    ``adapter_ids[j]``. Segments are sorted by start and do not overlap; empty segments are
    allowed. Rows in no segment (padding) get no adapter. The fields are Python ints because the
    layout is known on the host before the forward: reading it never waits for the device.
    """

    adapter_ids: tuple[int, ...]
    """Adapter id of each segment (an adapter may own several segments)."""
    starts: tuple[int, ...]
    """First row of each segment, ascending."""
    lengths: tuple[int, ...]
    """Rows of each segment, >= 0."""

    def __post_init__(self) -> None:
        for name in ("adapter_ids", "starts", "lengths"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if not len(self.adapter_ids) == len(self.starts) == len(self.lengths):
            raise ValueError(
                f"Segments: adapter_ids, starts and lengths differ in length "
                f"({len(self.adapter_ids)}, {len(self.starts)}, {len(self.lengths)})"
            )
        end = 0
        for j, (adapter, start, length) in enumerate(self):
            if adapter < 0:
                raise ValueError(f"Segments.adapter_ids[{j}] = {adapter}: must be >= 0")
            if length < 0:
                raise ValueError(f"Segments.lengths[{j}] = {length}: must be >= 0")
            if start < end:
                raise ValueError(
                    f"Segments.starts[{j}] = {start}: segments must be sorted and not overlap "
                    f"(the previous one ends at row {end})"
                )
            end = start + length

    @classmethod
    def packed(cls, adapter_ids: Sequence[int], lengths: Sequence[int]) -> Segments:
        """Back-to-back segments from row 0: a packed micro-batch, one segment per sequence or task."""
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        return cls(tuple(adapter_ids), tuple(starts[: len(lengths)]), tuple(lengths))

    @classmethod
    def padded(cls, adapter_ids: Sequence[int], lengths: Sequence[int], seq_len: int) -> Segments:
        """A right-padded ``(B, seq_len)`` batch: sequence ``b`` owns its first ``lengths[b]`` rows."""
        return cls(tuple(adapter_ids), tuple(b * seq_len for b in range(len(lengths))), tuple(lengths))

    @property
    def end(self) -> int:
        """One past the last covered row; the flattened input needs at least this many rows."""
        return self.starts[-1] + self.lengths[-1] if self.starts else 0

    def __len__(self) -> int:
        return len(self.adapter_ids)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """Yields ``(adapter_id, start, length)`` per segment."""
        return zip(self.adapter_ids, self.starts, self.lengths, strict=True)

    def within(self, first: int, end: int) -> Segments:
        """The segments' parts in rows ``[first, end)``, renumbered from row 0 (a TP rank's share of the rows:
        ``token_split.py``); a segment with no row there is dropped, adapters keep their ids."""
        kept = [
            (a, max(s, first) - first, min(s + n, end) - max(s, first)) for a, s, n in self if s < end and s + n > first
        ]
        return Segments(*zip(*kept, strict=True)) if kept else Segments((), (), ())

    def relabel(self, local: Mapping[int, int]) -> Segments:
        """Keeps the segments whose adapter is in ``local`` and renames it ``local[adapter]``."""
        kept = [(local[a], s, n) for a, s, n in self if a in local]
        return Segments(*zip(*kept, strict=True)) if kept else Segments((), (), ())


@dataclass(frozen=True, slots=True)
class LoraRouting:
    """One layer call's routing: the segments, and per adapter (by position) its scaling and dropout."""

    segments: Segments
    """Row segments; ``adapter_ids`` index ``scalings``, ``dropouts`` and the weight lists."""
    scalings: tuple[float, ...]
    """``s_a``: alpha / r, or alpha / sqrt(r) for rsLoRA (:attr:`LoraSpec.scaling`)."""
    dropouts: tuple[float, ...]
    """``p_a`` in [0, 1): the keep-mask rows of adapter ``a`` are scaled by ``1 / (1 - p_a)``."""

    def __post_init__(self) -> None:
        for name in ("scalings", "dropouts"):  # tuples: a routing is a cache key (of segment_runs, _tables)
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if len(self.scalings) != len(self.dropouts):
            raise ValueError(f"LoraRouting: {len(self.scalings)} scalings but {len(self.dropouts)} dropouts")
        if any(a >= len(self.scalings) for a in self.segments.adapter_ids):
            raise ValueError(f"LoraRouting: a segment names an adapter >= {len(self.scalings)}")
        if not all(0.0 <= p < 1.0 for p in self.dropouts):
            raise ValueError(f"LoraRouting.dropouts = {self.dropouts}: each must be in [0, 1)")
