"""Load a workload file into resolved tasks: specs plus each task's length distribution.

``load_workload`` is the one entry point every command uses. It parses the YAML once,
validates it (errors name the file and the field path), resolves the model, and builds
each task's length distribution after its overflow policy:

- ``truncate``: lengths above the context length become the context length;
- ``reject``: they are dropped and the rest renormalised.

Either way the overflowing probability mass is kept in ``Task.overflow_fraction`` so that
reports can say how much was cut or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError

from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.length_presets import find_preset, preset_distribution
from lorafleet.specs.lengths import LengthDistribution
from lorafleet.specs.model import MODEL_PRESETS, ModelSpec, resolve_model
from lorafleet.specs.workload import (
    DataSpec,
    LengthSpec,
    OverflowPolicy,
    TaskSpec,
    WorkloadSpec,
    describe_validation_error,
    fit_to_context,
)


@dataclass(frozen=True)
class Task:
    """A task with its length distribution resolved."""

    spec: TaskSpec
    raw_lengths: LengthDistribution
    """Lengths of the task's data before the overflow policy."""
    lengths: LengthDistribution
    """Lengths the task trains on, after the overflow policy (all <= context length)."""
    overflow_fraction: float
    """Probability that a raw sequence exceeds the context length (truncated or rejected)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def expected_tokens(self) -> float:
        """Expected tokens of this task in one global batch."""
        return self.lengths.expected_tokens(self.spec.batch_size)


@dataclass(frozen=True)
class Workload:
    """A validated workload: where it came from, the model, the cluster and the resolved tasks."""

    path: str
    spec: WorkloadSpec
    model: ModelSpec
    tasks: tuple[Task, ...]

    @property
    def cluster(self) -> ClusterSpec:
        return self.spec.cluster

    @property
    def max_length(self) -> int:
        """The longest sequence any task can present."""
        return max(t.lengths.max_length for t in self.tasks)

    def task(self, name: str) -> Task:
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(name)


def read_workload_spec(path: str | Path) -> WorkloadSpec:
    """Parse and validate a workload YAML file (no distributions built yet)."""
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(path, "", "no such file") from None
    except IsADirectoryError:
        raise InputError(path, "", "is a directory, expected a YAML file") from None
    except UnicodeDecodeError as err:
        raise InputError(path, "", f"not UTF-8 text ({err.reason})") from None
    except OSError as err:  # a symlink loop, no permission
        raise InputError(path, "", f"cannot read ({err.strerror or err})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise InputError(path, "", f"malformed YAML: {problem}{where}") from None
    if not isinstance(raw, dict):
        raise InputError(path, "", f"expected a mapping with a 'tasks' list, got {type(raw).__name__}")
    try:
        return WorkloadSpec.model_validate(raw)
    except ValidationError as err:
        raise InputError(path, *describe_validation_error(err.errors()[0])) from None


def _raw_distribution(
    spec: LengthSpec | None, data: DataSpec | None, ctx: int, workload: WorkloadSpec, source: tuple[str, str]
) -> LengthDistribution:
    if spec is not None and spec.preset is not None:
        return preset_distribution(find_preset(spec.preset))
    if spec is not None and spec.mean is not None:
        try:
            return LengthDistribution.from_moments(spec.mean, spec.skewness, spec.kurtosis, ctx)
        except ValueError as err:
            raise InputError(source[0], f"{source[1]}.lengths", str(err)) from None
    if spec is not None and spec.values is not None:
        return LengthDistribution.from_samples(np.asarray(spec.values))
    if spec is not None and spec.histogram is not None:
        return LengthDistribution.from_histogram(spec.histogram)
    dataset = spec.dataset if spec is not None else data
    return LengthDistribution.from_samples(_dataset_lengths(dataset, workload, source))


def _dataset_lengths(data: DataSpec, workload: WorkloadSpec, source: tuple[str, str]) -> np.ndarray:
    """Token lengths of every row of ``data``, tokenized as training will tokenize them."""
    from lorafleet.data.records import read_rows
    from lorafleet.data.tokenize import load_tokenizer, tokenize_rows

    tokenizer_dir = workload.tokenizer or workload.model
    tokenizer = load_tokenizer(tokenizer_dir, source[0], "tokenizer")
    rows = read_rows(data.path)
    if not rows:
        raise InputError(data.path, "", "dataset has no rows")
    return np.array([len(e) for e in tokenize_rows(tokenizer, rows, data.format, data.path)])


def _resolve_relative(spec: WorkloadSpec, base: Path) -> WorkloadSpec:
    """Dataset and tokenizer paths in a workload file are relative to that file."""

    def rel(p: str) -> str:
        return p if Path(p).is_absolute() else str(base / p)

    tasks = []
    for task in spec.tasks:
        update: dict = {}
        if task.data is not None:
            update["data"] = task.data.model_copy(update={"path": rel(task.data.path)})
        if task.lengths is not None and task.lengths.dataset is not None:
            ds = task.lengths.dataset
            update["lengths"] = task.lengths.model_copy(
                update={"dataset": ds.model_copy(update={"path": rel(ds.path)})}
            )
        tasks.append(task.model_copy(update=update))
    top: dict = {"tasks": tuple(tasks)}
    if spec.tokenizer is not None:
        top["tokenizer"] = rel(spec.tokenizer)
    if spec.model not in MODEL_PRESETS and (base / spec.model).exists():
        top["model"] = rel(spec.model)
    return spec.model_copy(update=top)


def apply_overflow(
    raw: LengthDistribution, ctx: int, policy: OverflowPolicy, source: tuple[str, str]
) -> tuple[LengthDistribution, float]:
    """The task's trained-on distribution and the overflowing mass under ``policy``: the overflow rule
    (``fit_to_context``) applied to every length ``raw`` puts mass on; a truncated length's mass moves to
    ``ctx``, a rejected one's is dropped and the rest renormalised."""
    fit = fit_to_context(raw.lengths, ctx, policy)
    if fit.rejected.all():
        raise InputError(
            source[0],
            f"{source[1]}.overflow",
            f"every sequence is longer than context_length {ctx}; reject drops them all",
        )
    over = float(raw.probs[fit.truncated | fit.rejected].sum())
    if fit.rejected.any():
        return raw.reject_above(ctx)[0], over
    return raw.truncate(ctx), over  # the identity when nothing overflows


def load_workload(path: str | Path) -> Workload:
    """Read, validate and resolve a workload file; every problem is an InputError."""
    return resolve_workload(_resolve_relative(read_workload_spec(path), Path(path).parent), str(path))


def resolve_workload(spec: WorkloadSpec, path: str) -> Workload:
    """Resolve a validated spec (paths already absolute or relative to the cwd); ``path`` names it in errors."""
    model = resolve_model(spec.model, str(path), "model")
    tasks = []
    for i, task in enumerate(spec.tasks):
        where = (str(path), f"tasks[{i}]")
        raw = _raw_distribution(task.lengths, task.data, task.context_length, spec, where)
        lengths, overflow = apply_overflow(raw, task.context_length, task.overflow, where)
        tasks.append(Task(spec=task, raw_lengths=raw, lengths=lengths, overflow_fraction=overflow))
    return Workload(path=str(path), spec=spec, model=model, tasks=tuple(tasks))
