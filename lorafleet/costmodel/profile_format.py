"""Versioned JSON profiles (``profiles/*.json``): measured records, fitted or analytic coefficients.

A profile is one JSON object::

    schema_version   1 (files of another version are refused, not guessed at)
    kind             "measured" (made by ``lorafleet profile``) or "analytic" (from a datasheet)
    model, gpu       preset names; gpus_per_node, dtype_bytes; adapters (tasks, ranks, optimizer)
    command          the command line that made the file; settings: how it was measured
    memory           per <tp, pp> (and ``recompute``: activation recomputation on): max tokens M
                     and its line (budget, static bytes, bytes per token)
    records          layer: per-layer fwd+bwd ms of padded {mbs, seq_len} or {packed: [lens]}
                     micro-batches per tp (``heldout`` ones are never fitted); head: embedding +
                     LM head + loss ms per tp and tokens; layer_forward, head_forward: the same
                     forward only (an evaluation's work; optional); replica: whole steps of
                     micro-batch lists; p2p, allreduce (2 ranks), optimizer: ms per size
    coefficients     what the cost model uses (fitted by ``lorafleet fit`` or analytic);
                     forward_layer_ms / forward_head_ms only where forward records were measured
    quality          fit quality: relative-error summaries by name

Reading validates everything and reports the first problem as an InputError naming the
file and the field (``records.layer[3].time_ms``). Writing is deterministic (sorted keys,
indent 2) and atomic.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from lorafleet.costmodel.adapters import AdapterLoad, TaskAdapter
from lorafleet.costmodel.cost_model import Interconnect
from lorafleet.costmodel.memory_model import StageMemory
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import N_COEFFS, AffineTime, LayerTimeCoeffs, Link, MicroBatchShape
from lorafleet.errors import InputError
from lorafleet.specs.io import read_json_object, write_text_atomic
from lorafleet.specs.lora import OptimizerName
from lorafleet.specs.workload import describe_validation_error, format_validation_loc

SCHEMA_VERSION = 1


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShapeJSON(_Schema):
    """A micro-batch: ``mbs`` sequences padded to ``seq_len``, or ``packed`` sequence lengths."""

    mbs: PositiveInt | None = None
    seq_len: PositiveInt | None = None
    packed: tuple[PositiveInt, ...] | None = None

    @model_validator(mode="after")
    def _one_layout(self) -> ShapeJSON:
        padded = self.mbs is not None and self.seq_len is not None
        if padded == (self.packed is not None) or (not padded and (self.mbs or self.seq_len)):
            raise ValueError("give either mbs and seq_len (padded) or packed (a non-empty list of lengths)")
        if self.packed is not None and not self.packed:
            raise ValueError("packed needs at least one sequence length")
        return self

    @property
    def shape(self) -> MicroBatchShape:
        if self.packed is not None:
            return MicroBatchShape.packed(self.packed)
        return MicroBatchShape.padded(self.mbs, self.seq_len)

    @classmethod
    def of(cls, mb: MicroBatchShape) -> ShapeJSON:
        if mb.padded_len is None:
            return cls(packed=mb.seq_lens)
        return cls(mbs=mb.n_seqs, seq_len=mb.padded_len)


class LayerRecord(ShapeJSON):
    """Forward and backward of one transformer block on one micro-batch, ms (median of repeats)."""

    tp: PositiveInt
    time_ms: PositiveFloat
    heldout: bool = False
    """Kept out of the fit, to check it."""


class HeadRecord(_Schema):
    """Embedding, final norm, LM head and loss, forward and input gradient, ms."""

    tp: PositiveInt
    tokens: PositiveInt
    time_ms: PositiveFloat


class ReplicaRecord(_Schema):
    """One whole training step of a replica over a list of micro-batches, ms."""

    tp: PositiveInt
    pp: PositiveInt = 1
    sync_replicas: PositiveInt = 1
    """Replicas in the adapters' gradient all-reduce (1: none)."""
    microbatches: tuple[ShapeJSON, ...] = Field(min_length=1)
    time_ms: PositiveFloat

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(self.tp, self.pp)


class SizeRecord(_Schema):
    """An operation on ``size`` bytes (transfers) or parameters (optimizer step), ms."""

    size: PositiveFloat
    time_ms: PositiveFloat


class MemoryRecord(_Schema):
    """Max tokens M of one config and the memory line behind it."""

    tp: PositiveInt
    pp: PositiveInt = 1
    recompute: bool = False
    """Activation recomputation on (every block re-runs its forward in the backward)."""
    max_tokens: int = Field(ge=0)
    budget_bytes: PositiveFloat
    static_bytes: NonNegativeFloat
    bytes_per_token: PositiveFloat

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(self.tp, self.pp, self.recompute)

    @property
    def line(self) -> StageMemory:
        return StageMemory(self.budget_bytes, self.static_bytes, self.bytes_per_token)


class AffineJSON(_Schema):
    fixed: NonNegativeFloat = 0.0
    slope: NonNegativeFloat = 0.0

    @property
    def time(self) -> AffineTime:
        return AffineTime(self.fixed, self.slope)

    @classmethod
    def of(cls, a: AffineTime) -> AffineJSON:
        return cls(fixed=a.fixed, slope=a.slope)


class LinkJSON(_Schema):
    latency_ms: NonNegativeFloat = 0.0
    gb_per_s: PositiveFloat | None = None
    """Bandwidth, GB/s; null for a link that costs nothing per byte."""

    @property
    def link(self) -> Link:
        return Link(self.latency_ms, math.inf if self.gb_per_s is None else self.gb_per_s)

    @classmethod
    def of(cls, link: Link) -> LinkJSON:
        return cls(latency_ms=link.latency_ms, gb_per_s=None if math.isinf(link.gb_per_s) else link.gb_per_s)


def _left_out_when_empty(value: object) -> bool:
    return not value


class Coefficients(_Schema):
    """Everything the cost model's time needs; ms throughout (LobRA's unit)."""

    layer_ms: dict[PositiveInt, tuple[NonNegativeFloat, ...]]
    """c1..c6 of t(b, s) per TP degree (LobRA Eq. 10)."""
    head_ms: dict[PositiveInt, AffineJSON]
    """Per TP degree, vs micro-batch tokens."""
    p2p_intra_node: LinkJSON
    p2p_inter_node: LinkJSON
    grad_sync: LinkJSON
    optimizer_ms: AffineJSON
    """Vs adapter parameters on one device."""
    forward_layer_ms: Annotated[
        dict[PositiveInt, tuple[NonNegativeFloat, ...]], Field(exclude_if=_left_out_when_empty)
    ] = {}
    """c1..c6 of a block's forward alone per TP degree, fitted from ``records.layer_forward``; empty (and left out of
    the JSON) where none was measured: the cost model then takes the forward as shares of ``layer_ms``
    (``CostModel.forward_time``)."""
    forward_head_ms: Annotated[dict[PositiveInt, AffineJSON], Field(exclude_if=_left_out_when_empty)] = {}
    """The head's forward alone per TP degree, vs micro-batch tokens, from ``records.head_forward``."""

    @model_validator(mode="after")
    def _six(self) -> Coefficients:
        for name, table in (("layer_ms", self.layer_ms), ("forward_layer_ms", self.forward_layer_ms)):
            for tp, c in table.items():
                if len(c) != N_COEFFS:
                    raise ValueError(f"{name}[{tp}] needs {N_COEFFS} coefficients, got {len(c)}")
        if set(self.forward_layer_ms) != set(self.forward_head_ms):
            raise ValueError("forward_layer_ms and forward_head_ms need the same TP degrees")
        return self

    @property
    def layer_time(self) -> dict[int, LayerTimeCoeffs]:
        return {tp: LayerTimeCoeffs(tuple(c)) for tp, c in self.layer_ms.items()}

    @property
    def head_time(self) -> dict[int, AffineTime]:
        return {tp: a.time for tp, a in self.head_ms.items()}

    @property
    def forward_layer_time(self) -> dict[int, LayerTimeCoeffs]:
        return {tp: LayerTimeCoeffs(tuple(c)) for tp, c in self.forward_layer_ms.items()}

    @property
    def forward_head_time(self) -> dict[int, AffineTime]:
        return {tp: a.time for tp, a in self.forward_head_ms.items()}

    def interconnect(self, gpus_per_node: int) -> Interconnect:
        return Interconnect(self.p2p_intra_node.link, self.p2p_inter_node.link, self.grad_sync.link, gpus_per_node)


class TaskAdapterJSON(_Schema):
    rank: PositiveInt
    targets: tuple[str, ...]

    @model_validator(mode="after")
    def _valid(self) -> TaskAdapterJSON:
        TaskAdapter(self.rank, self.targets)  # one source of truth for what an adapter may target
        return self


class AdaptersJSON(_Schema):
    optimizer: OptimizerName
    tasks: tuple[TaskAdapterJSON, ...] = Field(min_length=1)

    @property
    def load(self) -> AdapterLoad:
        return AdapterLoad(tuple(TaskAdapter(t.rank, t.targets) for t in self.tasks), self.optimizer)

    @classmethod
    def of(cls, load: AdapterLoad) -> AdaptersJSON:
        return cls(
            optimizer=load.optimizer, tasks=tuple(TaskAdapterJSON(rank=t.rank, targets=t.targets) for t in load.tasks)
        )


class Records(_Schema):
    layer: tuple[LayerRecord, ...] = ()
    head: tuple[HeadRecord, ...] = ()
    layer_forward: Annotated[tuple[LayerRecord, ...], Field(exclude_if=_left_out_when_empty)] = ()
    """The blocks forward only (no gradient kept), on the shapes of ``layer``: what an evaluation runs. Optional: a
    profile measured before them has none (and its JSON no such key)."""
    head_forward: Annotated[tuple[HeadRecord, ...], Field(exclude_if=_left_out_when_empty)] = ()
    """The head forward only, on the token counts of ``head``."""
    replica: tuple[ReplicaRecord, ...] = ()
    p2p: tuple[SizeRecord, ...] = ()
    allreduce: tuple[SizeRecord, ...] = ()
    """Ring all-reduces over 2 ranks."""
    optimizer: tuple[SizeRecord, ...] = ()


class Profile(_Schema):
    """One profile file (see the module docstring)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["measured", "analytic"]
    model: str
    gpu: str
    gpus_per_node: PositiveInt
    dtype_bytes: Literal[2, 4]
    adapters: AdaptersJSON
    command: str
    settings: dict[str, str | int | float | bool] = {}
    memory: tuple[MemoryRecord, ...] = Field(min_length=1)
    records: Records = Records()
    coefficients: Coefficients | None = None
    quality: dict[str, dict[str, int | float]] = {}

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        if self.kind == "analytic" and self.coefficients is None:
            raise ValueError("an analytic profile needs coefficients")
        if self.coefficients is not None:
            missing = sorted({m.tp for m in self.memory} - set(self.coefficients.layer_ms))
            if missing:
                raise ValueError(f"memory lists tp={missing[0]} but coefficients.layer_ms has no such entry")
        return self


def read_profile(path: str | Path) -> Profile:
    """Load and validate a profile; an InputError names the file and the first bad field."""
    path = Path(path)
    raw = read_json_object(path)
    version = raw.get("schema_version")
    if version is None:
        raise InputError(str(path), "schema_version", "missing")
    if version != SCHEMA_VERSION:
        raise InputError(
            str(path), "schema_version", f"unsupported version {version!r}; this lorafleet reads {SCHEMA_VERSION}"
        )
    try:  # strictly, as JSON: no boolean or 2.0 for a whole number, no string for a number (``specs.typed``)
        return Profile.model_validate_json(json.dumps(raw), strict=True)
    except ValidationError as err:
        where, message = describe_validation_error(err.errors()[0])
        raise InputError(str(path), where, message) from None


def write_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as sorted, indented JSON, atomically (a temporary file renamed into place)."""
    text = json.dumps(profile.model_dump(mode="json"), indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_text_atomic(path, text, mode=0o644)  # a profile is a shared artifact, whatever the umask


class CsvRow(_Schema):
    """A row of a LobRA-style layer-time CSV: tp, seq_len, mbs, optional pp and time (ms)."""

    tp: PositiveInt
    pp: PositiveInt = 1
    seq_len: PositiveInt
    mbs: PositiveInt
    time: PositiveFloat | None = None

    @property
    def shape(self) -> MicroBatchShape:
        return MicroBatchShape.padded(self.mbs, self.seq_len)


def read_layer_csv(path: str | Path) -> list[CsvRow]:
    """Rows of a ``tp,seq_len,mbs[,pp][,time]`` CSV (LobRA's profile layout); other columns are ignored."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ("tp", "seq_len", "mbs") if c not in (reader.fieldnames or [])]
            if missing:
                raise InputError(str(path), missing[0], "missing column")
            rows = []
            for i, raw in enumerate(reader, start=2):
                values = {k: _csv_number(v) for k, v in raw.items() if k in CsvRow.model_fields and v not in ("", None)}
                try:
                    rows.append(CsvRow.model_validate(values))
                except ValidationError as err:
                    first = err.errors()[0]
                    raise InputError(
                        str(path), f"line {i}: {format_validation_loc(first['loc'])}", first["msg"]
                    ) from None
    except FileNotFoundError:
        raise InputError(str(path), "", "no such file") from None
    if not rows:
        raise InputError(str(path), "", "no rows")
    return rows


def _csv_number(text: str) -> float | int | str:
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() else value
