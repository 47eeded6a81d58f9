"""Workload files: the tasks (tenants) to fine-tune, their data or length distributions,
their adapters and optimizers, and optionally the base model and cluster.

Example (``examples/lobra-7b.yaml``)::

    model: llama2-7b
    cluster: {gpu: A100-40GB, nodes: 2, gpus_per_node: 8}
    defaults:
      lora: {rank: 16, alpha: 16}
    tasks:
      - {name: dolly, preset: dolly}           # LobRA statistics: lengths, batch size, context
      - name: chat
        lengths: {mean: 180, skewness: 3.0, kurtosis: 15.0}
        batch_size: 64
        context_length: 4096
        overflow: reject

A task's length distribution comes from exactly one of: a dataset preset (``preset``),
``lengths`` (``preset``, ``stats`` keys mean/skewness/kurtosis, ``values``, ``histogram`` or
``dataset``), or its training ``data`` (tokenized with the workload's tokenizer).

A sequence longer than its task's ``context_length`` follows the task's ``overflow`` policy, by
the one rule of :func:`fit_to_context`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema, WithJsonSchema

from lorafleet.specs._base import FieldError, Float, Int, IntKey, Spec
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.data import DataSpec
from lorafleet.specs.evaluation import EarlyStoppingSpec, EvalSpec
from lorafleet.specs.hints import did_you_mean
from lorafleet.specs.length_presets import find_preset
from lorafleet.specs.lora import LoraSpec, OptimizerSpec, Quantization
from lorafleet.specs.names import task_name_error
from lorafleet.specs.recompute import RecomputePolicy
from lorafleet.specs.sweep import MEMBERS_DIR, SweepMembership, sweep_members


class OverflowPolicy(StrEnum):
    """What happens to a sequence longer than the task's context length (never silent; :func:`fit_to_context`)."""

    TRUNCATE = "truncate"
    """Cut it to the context length; counted in every report."""
    REJECT = "reject"
    """Drop it from the data; counted in every report."""


@dataclass(frozen=True)
class ContextFit:
    """Sequences fitted to a context length, one entry per sequence (:func:`fit_to_context`)."""

    lengths: np.ndarray
    """int64: the length each sequence trains at (a rejected one keeps its own)."""
    truncated: np.ndarray
    """bool: cut to the context length."""
    rejected: np.ndarray
    """bool: dropped."""


def fit_to_context(lengths: Sequence[int] | np.ndarray, context_length: int, policy: OverflowPolicy) -> ContextFit:
    """The overflow rule, its one implementation (the workload's length distributions, the sampled
    batches and the training data all apply it): a sequence longer than ``context_length`` is cut to
    it under ``truncate`` and dropped under ``reject``; the others stay as they are."""
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > context_length
    none = np.zeros_like(over)
    if policy is OverflowPolicy.TRUNCATE:
        return ContextFit(np.where(over, context_length, lengths), truncated=over, rejected=none)
    return ContextFit(lengths.copy(), truncated=none, rejected=over)


MAX_TASKS = 4096
"""The most tasks a workload holds, a sweep's members counted one by one."""
MAX_BATCH_SIZE = 1_000_000
"""The most sequences a task may put in one global batch."""
MAX_STEPS = (2**63 - 1) // MAX_BATCH_SIZE
"""The most global steps a run (``train --steps``, a task's ``steps``, ``deadline`` and ``start_step``) may
count: 9,223,372,036,854. A task's data cursor, its batches taken times its batch size, is a 64-bit sample
id; at this many steps the largest batch size still fits."""


class LengthSpec(Spec):
    """Where a task's sequence-length distribution comes from: set exactly one mode."""

    preset: str | None = None
    """A named dataset's published statistics (``lorafleet.specs.length_presets``)."""
    mean: Float | None = Field(None, gt=1)
    """Summary statistics mode: mean length in tokens (with ``skewness`` and ``kurtosis``)."""
    skewness: Float | None = None
    """Summary statistics mode: skewness of the lengths."""
    kurtosis: Float | None = None
    """Summary statistics mode: excess (Fisher) kurtosis of the lengths."""
    values: tuple[Int, ...] | None = None
    """Explicit list of observed lengths."""
    histogram: dict[IntKey, Float] | None = None
    """Length -> count (or weight)."""
    dataset: DataSpec | None = None
    """Measure the lengths of a dataset, tokenized with the workload's tokenizer."""

    @model_validator(mode="after")
    def _exactly_one_mode(self) -> LengthSpec:
        stats = (self.mean, self.skewness, self.kurtosis)
        modes = [
            name
            for name, present in (
                ("preset", self.preset is not None),
                ("mean/skewness/kurtosis", any(v is not None for v in stats)),
                ("values", self.values is not None),
                ("histogram", self.histogram is not None),
                ("dataset", self.dataset is not None),
            )
            if present
        ]
        if len(modes) != 1:
            raise ValueError(
                f"set exactly one of preset, mean/skewness/kurtosis, values, histogram, dataset (got {modes or 'none'})"
            )
        if modes[0] == "mean/skewness/kurtosis" and None in stats:
            raise ValueError("summary statistics need all of mean, skewness and kurtosis")
        if self.preset is not None and find_preset(self.preset) is None:
            raise ValueError(f"unknown dataset preset {self.preset!r}")
        if self.values is not None and (not self.values or min(self.values) < 1):
            raise ValueError("values must be a non-empty list of lengths >= 1")
        if self.histogram is not None:
            if (
                not self.histogram
                or min(self.histogram) < 1
                or min(self.histogram.values()) < 0
                or sum(self.histogram.values()) <= 0
            ):
                raise ValueError("histogram needs lengths >= 1 with non-negative counts summing to more than 0")
        return self


class TaskSpec(Spec):
    """One tenant's fine-tuning job."""

    name: str
    """Unique task name (letters, digits, ``_ . - =``); names the adapter directory."""
    preset: str | None = None
    """A dataset preset supplying defaults for ``lengths``, ``batch_size`` and ``context_length``."""
    lengths: LengthSpec | None = None
    """Length distribution (see LengthSpec); defaults to the preset's or the data's."""
    data: DataSpec | None = None
    """Training data; required to train, optional to plan."""
    batch_size: Int = Field(gt=0, le=MAX_BATCH_SIZE)
    """Sequences of this task in every global batch."""
    context_length: Int = Field(gt=0, le=1_048_576)
    """Longest sequence this task trains on, in tokens."""
    overflow: OverflowPolicy = OverflowPolicy.TRUNCATE
    """Policy for sequences longer than ``context_length``."""
    lora: LoraSpec = LoraSpec()
    """The task's adapter."""
    optimizer: OptimizerSpec = OptimizerSpec()
    """The task's optimizer and schedule."""
    steps: Int | None = Field(None, gt=0, le=MAX_STEPS)
    """Training steps (exclusive with ``epochs``); default: the run's step count."""
    epochs: Float | None = Field(None, gt=0)
    """Passes over ``data`` (exclusive with ``steps``)."""
    share: Float | None = Field(None, gt=0, le=1)
    """Target fraction of every global step's tokens: the task takes its batches in the steps that keep
    it near that fraction (``lorafleet.turns``); default: it takes part in every step."""
    deadline: Int | None = Field(None, gt=0, le=MAX_STEPS)
    """The global step by which the task must have taken its last batch: it takes part in every step
    once it has no slack left, whatever its share (needs ``steps``)."""
    start_step: Int = Field(0, ge=0, le=MAX_STEPS)
    """The first global step the task takes part in (a task added to a running job by its queue)."""
    eval: EvalSpec | None = None
    """Evaluation on held-out rows (``specs.evaluation``): its loss and token accuracy, and the best adapter."""
    early_stopping: EarlyStoppingSpec | None = None
    """Stop the task once its evaluation loss stops improving (needs ``eval``; ``specs.evaluation``)."""
    member_of: SweepMembership | None = None
    """The sweep this task is a member of (set when a task's ``sweep`` expands: ``specs.sweep``)."""

    @property
    def seed_name(self) -> str:
        """The name its data order and held-out rows are drawn by: its sweep's for a sweep's member (every member
        sees the same batches and is evaluated on the same rows), else its own."""
        return self.member_of.sweep if self.member_of is not None else self.name

    @property
    def export_dir(self) -> str:
        """Its adapter's folder under ``<out>/adapters``: its name, or ``<sweep>/members/<name>`` for a sweep's
        member (the sweep's winner is promoted to ``<sweep>/``: ``train.promote``)."""
        return f"{self.member_of.sweep}/{MEMBERS_DIR}/{self.name}" if self.member_of is not None else self.name

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or raw.get("preset") is None:
            return raw
        preset = find_preset(str(raw["preset"]))
        if preset is None:
            return raw  # reported by the field validator, with the field's name
        filled = {"batch_size": preset.batch_size, "context_length": preset.context_length}
        if raw.get("data") is None:
            filled["lengths"] = {"preset": preset.id}
        return {**filled, **raw}

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        error = task_name_error(value)
        if error is not None:
            raise ValueError(error)
        return value

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and find_preset(value) is None:
            raise ValueError(f"unknown dataset preset {value!r}")
        return value

    @model_validator(mode="after")
    def _has_lengths(self) -> TaskSpec:
        if self.lengths is None and self.data is None:
            raise ValueError("needs one of preset, lengths or data")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set steps or epochs, not both")
        if self.early_stopping is not None and self.eval is None:
            raise FieldError(("early_stopping",), "early stopping needs an eval (eval: {split: 0.05})")
        if self.deadline is not None:
            if self.steps is None:
                raise ValueError("a deadline needs steps")
            if self.start_step + self.steps > self.deadline:
                raise ValueError(
                    f"cannot take {self.steps} steps from step {self.start_step} by its deadline, step {self.deadline}"
                )
        return self


QUANTIZE_AUTO = "auto"
QUANTIZE_NONE = "none"
"""``quantize``'s words for the planner's choice of base (:func:`base_choice_fields`) and, in a list, the unquantized
base."""
BASE_PREFERENCE: tuple[Quantization | None, ...] = (None, Quantization.INT8, Quantization.NF4)
"""Every base, in the order a tie between two plans goes (the least rounding of the base first)."""
_BASES = [q.value for q in Quantization]
QUANTIZE_SCHEMA = {
    "anyOf": [
        {"enum": _BASES},
        {"type": "null"},
        {"const": QUANTIZE_AUTO},
        {"type": "array", "items": {"enum": [QUANTIZE_NONE, *_BASES, None]}, "minItems": 1, "uniqueItems": True},
    ]
}
"""What ``quantize`` takes as written (``lorafleet schema``): a base, null, ``auto`` or a list of bases."""


class WorkloadSpec(Spec):
    """A workload file: tasks, plus the base model and cluster they run on."""

    model: str = "llama2-7b"
    """A model preset (``lorafleet.specs.model.MODEL_PRESETS``) or a local HF model directory / config.json."""
    tokenizer: str | None = None
    """Local tokenizer directory the ``data`` (and ``dataset`` lengths) are tokenized with; default: the one
    that comes with the model's weights (``lorafleet.data.model_source.data_tokenizer``)."""
    base_model_id: str | None = Field(None, min_length=1)
    """The Hub id (or path) written into each adapter's ``adapter_config.json`` as ``base_model_name_or_path``
    (and its model card's ``base_model``); default: the model preset's Hub id, else the model directory as
    given (``lorafleet.specs.model.adapter_base_model``)."""
    cluster: ClusterSpec = ClusterSpec()
    """The GPUs to plan for."""
    recompute: RecomputePolicy = RecomputePolicy.AUTO
    """Activation recomputation: ``auto`` (the planner picks per config), ``off`` or ``on``."""
    quantize: Annotated[Quantization | None, WithJsonSchema(QUANTIZE_SCHEMA)] = None
    """QLoRA: the shared base's projections stored ``nf4`` or ``int8`` and dequantized in the forward, every tenant
    over the one quantized base (``executor/torch/quantized_base.py``); null: the base in the run's dtype. Written
    ``auto`` or as a list of bases (``[none, nf4]``), the planner chooses the base (:attr:`quantize_candidates`)."""
    quantize_candidates: SkipJsonSchema[tuple[Quantization | None, ...] | None] = None
    """The bases the planner chooses among (``planner.base_choice``), set from ``quantize: auto`` (none and nf4) or
    ``quantize: [none, int8, nf4]`` (any two or more, ``none`` the unquantized one), in the order ties go to: the
    unquantized base, then int8, then nf4. None: ``quantize`` is the one base. Written back as ``quantize``."""
    seed: Int = Field(0, ge=0)
    """Seed of every sampled global batch."""
    tasks: tuple[TaskSpec, ...] = Field(min_length=1, max_length=MAX_TASKS)
    """The tenants; at least one. A task with a ``sweep`` is its members (``specs.sweep``)."""
    defaults: dict[str, Any] = Field(default_factory=dict)
    """Task fields every task takes unless it sets its own (merged key by key, nested mappings too); kept,
    after merging, for the tasks that join later (a queued task, an arrival trace's)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_defaults(cls, raw: Any) -> Any:
        """Merge ``defaults:`` (lora, optimizer, overflow, ...) under every task's own keys, then expand each
        task's ``sweep`` into its members (``specs.sweep``)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("tasks"), list):
            return raw
        raw = dict(raw)
        if "defaults" in raw:
            defaults = raw["defaults"]
            if defaults is None:
                defaults = raw["defaults"] = {}
            if not isinstance(defaults, dict):
                raise ValueError("defaults must be a mapping")
            raw["tasks"] = [deep_merge(defaults, t) if isinstance(t, dict) else t for t in raw["tasks"]]
        raw["tasks"] = expand_sweeps(raw["tasks"])
        return raw

    @model_validator(mode="before")
    @classmethod
    def _base_choice(cls, raw: Any) -> Any:
        """``quantize: auto`` or a list of bases as :attr:`quantize_candidates` (:func:`base_choice_fields`)."""
        return base_choice_fields(raw) if isinstance(raw, dict) else raw

    @model_serializer(mode="wrap")
    def _dump_base_choice(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The candidates written back as the user writes them, ``quantize: [none, nf4]``."""
        raw = handler(self)
        if self.quantize_candidates is not None:
            raw.pop("quantize_candidates", None)
            raw["quantize"] = [QUANTIZE_NONE if q is None else q.value for q in self.quantize_candidates]
        return raw

    @field_validator("recompute", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare ``on``/``off`` as a boolean: take it as the word it was."""
        return ("on" if value else "off") if isinstance(value, bool) else value

    @field_validator("tasks")
    @classmethod
    def _unique_names(cls, tasks: tuple[TaskSpec, ...]) -> tuple[TaskSpec, ...]:
        seen: set[str] = set()
        sweeps = {t.member_of.sweep for t in tasks if t.member_of is not None}
        for i, task in enumerate(tasks):
            if task.name in seen:
                raise FieldError((i, "name"), f"task name {task.name!r} appears twice")
            if task.name in sweeps:
                raise FieldError((i, "name"), f"task name {task.name!r} is also a sweep's name")
            seen.add(task.name)
        return tasks


def base_choice_fields(raw: dict) -> dict:
    """A raw workload's ``quantize: auto`` (the unquantized base and NF4, QLoRA's) or list of bases as
    ``quantize_candidates`` in :data:`BASE_PREFERENCE`'s order; a list of one base is that base. FieldError at
    ``quantize`` (``quantize[i]``) for an empty list, an unknown base or one given twice, and at a pool's
    ``quantize``: one base for the whole fleet (docs/multi_lora.md)."""
    given = raw.get("quantize")
    pools = raw.get("cluster", {}).get("pools") if isinstance(raw.get("cluster"), dict) else None
    for k, pool in enumerate(pools if isinstance(pools, list) else ()):
        if isinstance(pool, dict) and "quantize" in pool:
            raise FieldError(
                ("cluster", "pools", k, "quantize"),
                "the base is the whole fleet's: write quantize (a base, auto or a list) at the file's top level; a "
                "tenant the dispatcher splits across pools would learn over two functions (docs/multi_lora.md)",
            )
    if "quantize_candidates" in raw:
        raise FieldError(("quantize_candidates",), "is set from quantize: auto or a list of bases; write those")
    if given == QUANTIZE_AUTO:
        given = [QUANTIZE_NONE, Quantization.NF4.value]
    if not isinstance(given, list | tuple):
        return raw
    if not given:
        raise FieldError(("quantize",), "an empty list; give the bases to choose among, e.g. [none, nf4], or auto")
    words = {QUANTIZE_NONE: None, None: None, **{q.value: q for q in Quantization}}
    bases: list[Quantization | None] = []
    for i, item in enumerate(given):
        if not isinstance(item, str | None) or item not in words:
            known = ", ".join(w for w in words if w is not None)
            raise FieldError(("quantize", i), f"{describe_value(item)} is not a base; the bases are {known}")
        if words[item] in bases:
            raise FieldError(("quantize", i), f"{item or QUANTIZE_NONE} is listed twice")
        bases.append(words[item])
    ordered = tuple(b for b in BASE_PREFERENCE if b in bases)
    one = len(ordered) == 1
    return {**raw, "quantize": ordered[0] if one else None, "quantize_candidates": None if one else ordered}


def expand_sweeps(tasks: Sequence[Any]) -> list[Any]:
    """The workload's raw tasks (after ``defaults``) with each task that carries a ``sweep`` replaced by its members
    (``specs.sweep``); FieldError at ``tasks[i]...`` when the task, without its sweep, or its sweep is not valid."""
    out: list[Any] = []
    for i, raw in enumerate(tasks):
        if not isinstance(raw, dict) or raw.get("sweep") is None:
            out.append(raw)
            continue
        try:
            TaskSpec.model_validate({k: v for k, v in raw.items() if k != "sweep"})
        except ValidationError as error:
            first = error.errors()[0]
            raise FieldError(("tasks", i, *validation_error_loc(first)), describe_validation_error(first)[1]) from None
        out.extend(sweep_members(raw, ("tasks", i, "sweep")))
    return out


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``, merging nested mappings key by key."""
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def resolve_path(path: str, base: Path) -> str:
    """The one rule for a path written in a file: a relative path is relative to ``base`` (the file's folder,
    or the working directory to make it absolute); an absolute one stays as it is."""
    return path if Path(path).is_absolute() else str(base / path)


def resolve_data_paths(task: TaskSpec, base: Path) -> TaskSpec:
    """``task`` with its data paths (``data.path``, ``eval.data.path`` and ``lengths.dataset.path``) resolved
    against ``base`` (:func:`resolve_path`): a workload's, a trace's or a queued request's tasks, against their
    file's folder."""
    update: dict[str, Any] = {}
    if task.data is not None:
        update["data"] = task.data.model_copy(update={"path": resolve_path(task.data.path, base)})
    if task.eval is not None and task.eval.data is not None:
        held = task.eval.data.model_copy(update={"path": resolve_path(task.eval.data.path, base)})
        update["eval"] = task.eval.model_copy(update={"data": held})
    if task.lengths is not None and task.lengths.dataset is not None:
        dataset = task.lengths.dataset.model_copy(update={"path": resolve_path(task.lengths.dataset.path, base)})
        update["lengths"] = task.lengths.model_copy(update={"dataset": dataset})
    return task.model_copy(update=update) if update else task


def describe_validation_error(error: dict) -> tuple[str, str]:
    """One pydantic error as (field path, message), with a FieldError's own location appended. A wrong
    shape says what the field takes: a mapping-typed field given a scalar or a list names the keys of its
    model (which are required), a list-typed one says it takes a list."""
    loc = validation_error_loc(error)
    msg = error["msg"].removeprefix("Value error, ")
    if error.get("type") in ("model_type", "dict_type"):
        msg = _expected_mapping(error) or msg
    elif error.get("type") in ("tuple_type", "list_type"):
        msg = f"takes a list, got {describe_value(error.get('input'))}"
    elif error.get("type") == "unexpected_keyword_argument":  # an unknown key of a dataclass: say it as of a model
        msg = "Extra inputs are not permitted"
    if error.get("type") in ("extra_forbidden", "unexpected_keyword_argument"):
        hint = did_you_mean(loc)  # PEFT's r, TRL's max_seq_length, a typo (specs.hints)
        msg = f"{msg}; {hint}" if hint else msg
    elif error.get("type") in TYPE_WORDS:
        msg = f"{TYPE_WORDS[error['type']]}, got {describe_value(error.get('input'))}"
    return format_validation_loc(loc), msg


TYPE_WORDS = {
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
}
"""What a value of the wrong type should have been (strict numbers and switches: ``specs._base``)."""


def validation_error_loc(error: dict) -> tuple[int | str, ...]:
    """One pydantic error's location, with a FieldError's own location appended."""
    loc = tuple(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):
        loc += cause.loc
    return loc


def _spec_class(name: object) -> type[BaseModel] | None:
    """The pydantic model called ``name`` (a model_type error names its class only)."""
    todo: list[type[BaseModel]] = [BaseModel]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name and cls is not BaseModel:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def describe_value(value: object) -> str:
    """The wrong value as a user would name it: ``a string 'x.jsonl'``, ``an integer 8``, ``a list``."""
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    kind = kinds.get(type(value), "nothing" if value is None else f"a {type(value).__name__}")
    if isinstance(value, bool | int | float | str):
        text = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return f"{kind} {text}"
    return kind


def _expected_mapping(error: dict) -> str | None:
    """For a mapping-shaped field given something else: the keys it takes, which are required, and
    (for a scalar where one key is required) what was probably meant."""
    got = describe_value(error.get("input"))
    if error["type"] == "dict_type":
        return f"takes a mapping, got {got}"
    model = _spec_class(error.get("ctx", {}).get("class_name"))
    if model is None:
        return None
    fields = model.model_fields
    required = [k for k, f in fields.items() if f.is_required()]
    keys = ", ".join(f"{k} (required)" if k in required else k for k in fields)
    msg = f"takes a mapping with keys: {keys}; got {got}"
    value = error.get("input")
    if len(required) == 1 and isinstance(value, str | int | float) and not isinstance(value, bool):
        msg += f"; did you mean {{{required[0]}: {value}}}?"
    return msg


def format_validation_loc(loc: tuple[int | str, ...]) -> str:
    """Pydantic's error location as a field path: ``("tasks", 2, "lora", "rank")`` -> ``tasks[2].lora.rank``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "tagged-union")):
            continue  # validator wrappers pydantic inserts into locations
        else:
            out += f".{part}" if out else str(part)
    return out
