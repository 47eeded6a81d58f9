"""How a deployment's steps are dispatched: the policy a plan is judged under and run with.

- :class:`DispatchOptions`: one step's bucketing, balance and micro-batch options
  (:func:`lorafleet.dispatch.dispatch_step`).
- :class:`Recalibration`: how measured replica times correct the cost model between steps
  (:mod:`lorafleet.dispatch.recalibration`).
- :class:`DispatchPolicy`: both, plus LobRA's static buckets for its baseline and the pipeline
  window (how many steps a pipelined replica streams before it drains,
  :mod:`lorafleet.costmodel.schedule`). A :class:`~lorafleet.plans.DeploymentPlan` records the
  policy it was judged under, and ``simulate``, ``dispatch`` and ``train`` run it (DESIGN: "A plan
  is a contract"); the planner is given one whole (``PlannerOptions.policy``).

**One field table.** The dataclass fields below are the policy's only list of itself:
:func:`policy_fields` walks them into :class:`PolicyField` rows (the key a plan's JSON and an
override name it by, its type, default, doc string and command-line flag), and everything else is
generated from the rows: the JSON a plan records (:meth:`DispatchPolicy.to_json`,
:meth:`~DispatchPolicy.from_json`), its JSON Schema (:func:`policy_json_schema`), the overrides a
command applies (:meth:`DispatchPolicy.with_overrides`, keyed by field key) and the flags that
give them (``commands._plan_flags``, from each field's ``flag`` and doc string). A field without a
``flag`` is set only in a plan file. In the JSON the options' fields sit at the top level (the
layout plans of schema 2 have) and the recalibration's under ``recalibration``.

Plain data below the plans and the dispatcher, so both can hold it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from lorafleet.errors import InputError, coerce_enum_fields
from lorafleet.specs._base import Bool, Float, Int
from lorafleet.specs.field_docs import documented, field_help
from lorafleet.specs.fields import flag
from lorafleet.specs.solver import SolverName

OPTIONS_SOURCE = "<dispatch options>"
_DOCUMENTED = documented(extra="forbid")
"""How pydantic reads the policy's dataclasses: no unknown keys; each field's doc string is its JSON Schema description
(``specs.field_docs``)."""


class DispatchMethod(StrEnum):
    FAST = "fast"
    """Greedy water-filling over buckets, then local search (``balance.balance_fast``); milliseconds."""
    EXACT = "exact"
    """The aggregated (config, bucket) MILP (``ilp.py``), bounded by the fast result; falls back to it."""
    LENGTH = "length"
    """LobRA's length-based "GROUP" baseline: each bucket only on its tightest config."""


class MicroBatchMode(StrEnum):
    PADDING = "padding"
    """Every row padded to its bucket's boundary (LobRA)."""
    PACKING = "packing"
    """Sequences concatenated up to M tokens, boundaries kept (varlen attention)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchOptions:
    """Options of one step's dispatch; strings are accepted for the enums and converted."""

    __pydantic_config__ = _DOCUMENTED

    microbatch_mode: MicroBatchMode = field(default=MicroBatchMode.PACKING, metadata=flag("--microbatch"))
    """padding or packing micro-batches: rows padded to their bucket's boundary (LobRA), or sequences
    packed up to M tokens (lorafleet's default, with variable-length attention)"""
    n_buckets: Int = field(default=16, metadata=flag("--buckets", "R"))
    """R, the most buckets per step (LobRA's 16; raised to the number of memory classes present)"""
    bucket_alignment: Int = field(default=16, metadata=flag("--alignment", "TOKENS"))
    """bucket boundaries are lengths rounded up to a multiple of this many tokens"""
    method: DispatchMethod = field(default=DispatchMethod.FAST, metadata=flag("--method"))
    """how sequences are balanced over configs: fast (milliseconds), exact (the MILP, bounded by the fast
    answer, which stands when a solve gives nothing) or length (LobRA's length-based baseline)"""
    solver: SolverName = field(default=SolverName.CBC, metadata=flag("--solver"))
    """MILP back end of --method exact: cbc, scip or highs"""
    time_limit_s: Float = field(default=10.0, metadata=flag("--time-limit", "S"))
    """seconds one exact solve may take; on a timeout without a solution the fast dispatch is used"""
    gap_rel: Float = field(default=1e-4, metadata=flag("--gap", "REL"))
    """relative optimality gap an exact solve may stop at"""
    choose_buckets_by_makespan: Bool = field(default=False, metadata=flag("--choose-buckets-by-makespan"))
    """pick the bucket count <= R with the least estimated makespan, not the least padding"""

    def __post_init__(self) -> None:
        coerce_enum_fields(
            self, OPTIONS_SOURCE, {"method": DispatchMethod, "solver": SolverName, "microbatch_mode": MicroBatchMode}
        )
        if not self.time_limit_s > 0:
            raise InputError(OPTIONS_SOURCE, "time_limit_s", f"must be > 0 seconds, got {self.time_limit_s}")
        if not 0 <= self.gap_rel < 1:
            raise InputError(OPTIONS_SOURCE, "gap_rel", f"must be in [0, 1), got {self.gap_rel}")
        if self.n_buckets < 1:
            raise InputError(OPTIONS_SOURCE, "n_buckets", f"must be >= 1, got {self.n_buckets}")
        if self.bucket_alignment < 1:
            raise InputError(OPTIONS_SOURCE, "bucket_alignment", f"must be >= 1 token, got {self.bucket_alignment}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Recalibration:
    """Per-replica correction of the cost model from measured busy times (``dispatch.recalibration``)."""

    __pydantic_config__ = _DOCUMENTED

    enabled: Bool = field(default=True, metadata=flag("--recalibrate"))
    """correct the cost model from measured replica times between steps"""
    smoothing: Float = 0.5
    """beta of the debiased exponential average of measured / predicted: the weight of the past"""
    bound: Float = 4.0
    """a replica's correction stays within [1 / bound, bound] times the fleet's median correction"""

    def __post_init__(self) -> None:
        if not 0 <= self.smoothing < 1:
            raise InputError(OPTIONS_SOURCE, "recalibration.smoothing", f"must be in [0, 1), got {self.smoothing}")
        if not (math.isfinite(self.bound) and self.bound >= 1):
            raise InputError(OPTIONS_SOURCE, "recalibration.bound", f"must be a finite number >= 1, got {self.bound}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchPolicy:
    """How a deployment's sequences are bucketed, balanced and cut into micro-batches, step after step."""

    __pydantic_config__ = _DOCUMENTED

    options: DispatchOptions = field(default_factory=DispatchOptions, metadata={"flatten": True})
    """the dispatcher's options: balance method, padding or packing, dynamic bucket count"""
    static_boundaries: tuple[Int, ...] = ()
    """fixed padding buckets (LobRA's Task-Fused baseline); empty: the dispatcher's per-step DP"""
    recalibration: Recalibration = field(default_factory=Recalibration)
    """online correction of the cost model from what the run measures"""
    pipeline_window: Int = field(default=8, metadata=flag("--pipeline-window", "N"))
    """steps a pipelined replica streams before it drains (1: 1F1B flushed every step, LobRA's); the
    dispatcher and the executors price and run this window"""

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_window, bool) or not isinstance(self.pipeline_window, int):
            raise InputError(
                OPTIONS_SOURCE, "pipeline_window", f"must be a whole number of steps, got {self.pipeline_window!r}"
            )
        if self.pipeline_window < 1:
            raise InputError(OPTIONS_SOURCE, "pipeline_window", f"must be >= 1 step, got {self.pipeline_window}")
        bounds = self.static_boundaries
        if any(b < 1 for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise InputError(
                OPTIONS_SOURCE, "static_boundaries", f"must be positive and strictly increasing, got {list(bounds)}"
            )

    def describe(self) -> str:
        """``packing, R=16, alignment 16, fast, recalibrated, pipeline window 8`` (what a command prints it runs)."""
        o = self.options
        buckets = f"static buckets {list(self.static_boundaries)}" if self.static_boundaries else f"R={o.n_buckets}"
        extra = ", by makespan" if o.choose_buckets_by_makespan else ""
        cal = "recalibrated" if self.recalibration.enabled else "not recalibrated"
        return (
            f"{o.microbatch_mode.value}, {buckets}{extra}, alignment {o.bucket_alignment}, {o.method.value}, {cal}, "
            f"pipeline window {self.pipeline_window}"
        )

    def value(self, key: str) -> Any:
        """The value of the field ``key`` (``n_buckets``, ``recalibration.enabled``: :func:`policy_fields`)."""
        node: Any = self
        for attr in field_of(key).attrs:
            node = getattr(node, attr)
        return node

    def with_overrides(self, changes: Mapping[str, Any]) -> DispatchPolicy:
        """This policy with the fields ``changes`` names (field key -> value) replaced, each value checked as the
        field checks it: an InputError naming :data:`OPTIONS_SOURCE` and the field (:func:`flag_error`
        turns it into the flag's)."""
        if not changes:
            return self
        return _replaced(self, [(field_of(key).attrs, value) for key, value in changes.items()])

    def to_json(self) -> dict[str, Any]:
        """The policy as a plan records it (:func:`policy_fields`: options at the top, ``recalibration`` nested)."""
        data: dict[str, Any] = {}
        for f in policy_fields():
            *groups, last = f.key.split(".")
            node = data
            for group in groups:
                node = node.setdefault(group, {})
            node[last] = _jsonable(self.value(f.key))
        return data

    @classmethod
    def from_json(cls, data: Any, source: str, where: str = "policy") -> DispatchPolicy:
        """The policy of a JSON object (a plan's ``policy``), each field validated strictly as JSON; an
        InputError names ``source`` and the field path (``policy.recalibration.bound``), an unknown key too.

        A policy without ``pipeline_window`` was written before the window existed, when every
        pipelined step was 1F1B flushed (the plan was judged under that): it reads as 1, not as
        today's default.
        """
        from lorafleet.specs.typed import join_path, validate_strict

        values = {}
        for key, raw in _flattened(data, source, where):
            values[key] = validate_strict(field_of(key).type, raw, source, join_path(where, key))
        values.setdefault("pipeline_window", 1)
        try:
            return cls().with_overrides(values)
        except InputError as err:
            raise InputError(source, join_path(where, err.field), err.msg) from None


def _replaced(node: Any, changes: list[tuple[tuple[str, ...], Any]]) -> Any:
    """``node`` (a dataclass) with each ``(attribute path, value)`` of ``changes`` set, rebuilt bottom-up so
    every level's ``__post_init__`` checks its new values."""
    direct = {path[0]: value for path, value in changes if len(path) == 1}
    nested: dict[str, list[tuple[tuple[str, ...], Any]]] = {}
    for path, value in changes:
        if len(path) > 1:
            nested.setdefault(path[0], []).append((path[1:], value))
    for attr, inner in nested.items():
        direct[attr] = _replaced(getattr(node, attr), inner)
    return dataclasses.replace(node, **direct)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


def _flattened(data: Any, source: str, where: str) -> Iterator[tuple[str, Any]]:
    """``(field key, JSON value)`` of a policy object, an InputError for a key no field has."""
    from lorafleet.specs.typed import join_path

    if not isinstance(data, dict):
        raise InputError(source, where, f"expected an object, got {type(data).__name__}")
    keys = {f.key for f in policy_fields()}
    groups = {k.split(".")[0] for k in keys if "." in k}
    for name, value in data.items():
        if name in groups:
            inner = sorted(k.split(".", 1)[1] for k in keys if k.startswith(f"{name}."))
            if not isinstance(value, dict):
                raise InputError(source, join_path(where, name), f"expected {{{', '.join(inner)}}}")
            for sub, raw in value.items():
                if sub not in inner:
                    raise InputError(source, join_path(where, f"{name}.{sub}"), "unknown field")
                yield f"{name}.{sub}", raw
        elif name in keys:
            yield name, value
        else:
            raise InputError(source, join_path(where, str(name)), "unknown field")


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyField:
    """One field of :class:`DispatchPolicy` as every surface names it (the module's field table)."""

    key: str
    """Its name in a plan's policy JSON and in overrides: ``n_buckets``, ``recalibration.enabled``."""
    attrs: tuple[str, ...]
    """Its attribute path in a DispatchPolicy: ``("options", "n_buckets")``."""
    owner: type
    """The dataclass that declares it (``Recalibration`` for ``recalibration.enabled``)."""
    type: Any
    default: Any
    flag: str | None = None
    """The command-line flag that overrides it (None: set in a plan file only)."""
    metavar: str | None = None

    @property
    def doc(self) -> str:
        """Its doc string, on one line: the help of its flag and the description in its JSON Schema (read from the
        source when asked for, ``specs.field_docs``: a plan's JSON, read or written, needs none)."""
        return field_help(self.owner, self.attrs[-1])


@functools.cache
def policy_fields() -> tuple[PolicyField, ...]:
    """The field table: every leaf field of :class:`DispatchPolicy`, in declaration order."""
    return tuple(_walk(DispatchPolicy, (), ()))


def field_of(key: str) -> PolicyField:
    """The field called ``key``; a KeyError (a programming error, not a user's) when there is none."""
    table = {f.key: f for f in policy_fields()}
    return table[key]


def flag_error(err: InputError, source: str = "<args>") -> InputError:
    """An InputError a policy field raised (:data:`OPTIONS_SOURCE`) as the error of the flag that set it."""
    if err.path != OPTIONS_SOURCE:
        return err
    by_key = {f.key: f for f in policy_fields()}
    known = by_key.get(err.field)
    return InputError(source, known.flag if known is not None and known.flag else err.field, err.msg)


def _walk(cls: type, attrs: tuple[str, ...], keys: tuple[str, ...]) -> Iterator[PolicyField]:
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _walk(kind, (*attrs, f.name), keys if f.metadata.get("flatten") else (*keys, f.name))
            continue
        yield PolicyField(
            key=".".join((*keys, f.name)),
            attrs=(*attrs, f.name),
            owner=cls,
            type=kind,
            default=getattr(defaults, f.name),
            flag=f.metadata.get("flag"),
            metavar=f.metadata.get("metavar"),
        )


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema of a plan's ``policy`` object, generated from the field table."""
    from lorafleet.specs.typed import adapter

    root: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": {}}
    for f in policy_fields():
        *groups, last = f.key.split(".")
        node = root
        for group in groups:
            node = node["properties"].setdefault(
                group, {"type": "object", "additionalProperties": False, "properties": {}}
            )
        schema = adapter(f.type).json_schema()
        schema.pop("title", None)
        node["properties"][last] = {**schema, "default": _jsonable(f.default), "description": f.doc}
    return root
