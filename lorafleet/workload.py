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

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import ValidationError

from lorafleet.errors import InputError
from lorafleet.specs.architecture import model_targets
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
    describe_value,
    fit_to_context,
    format_validation_loc,
    resolve_data_paths,
    resolve_path,
)

ARGS = "<args>"


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
    histogram: Mapping[int, int] | None = field(default=None, compare=False)
    """``{token length: rows}`` of its data when its lengths read a dataset (``reads_dataset``), else None: what a
    run file carries so that a rank resolves the task without tokenizing it (``train.run_file``)."""

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


def read_yaml(path: str | Path) -> Any:
    """A YAML file's contents; a file that cannot be read or parsed is an InputError naming it."""
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
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise InputError(path, "", f"malformed YAML: {problem}{where}") from None


@dataclass(frozen=True)
class _Override:
    """One ``--set`` item as applied: the key as given and where it landed in the raw mapping."""

    item: str
    key: str
    loc: tuple[int | str, ...]


def apply_overrides(raw: dict, sets: Sequence[str]) -> dict:
    """A copy of the workload mapping ``raw`` with each ``KEY=VALUE`` of ``sets`` applied in order.

    KEY is a dotted path (``cluster.nodes``, ``defaults.lora.rank``); an item of a list is addressed by
    its ``name`` (``tasks.dolly.batch_size``) or, failing that, its index (``tasks.0.batch_size``). A
    missing mapping on the way is created. VALUE is parsed as YAML (``32``, ``true``, ``[1, 2]``,
    ``{rank: 8}``, ``cosine``). A malformed item, an unknown task or a path through a scalar is an
    InputError naming ``<args>`` and the ``--set`` key; the result is validated like the file."""
    return _apply_overrides(raw, sets)[0]


def _apply_overrides(raw: dict, sets: Sequence[str]) -> tuple[dict, tuple[_Override, ...]]:
    if not sets:
        return raw, ()
    out = copy.deepcopy(raw)
    applied = []
    for item in sets:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(ARGS, "--set", f"expected KEY=VALUE, got {item!r}")
        parts = key.split(".")
        if "" in parts:
            raise InputError(ARGS, f"--set {key}", "a key is dotted names with none empty (e.g. tasks.dolly.lora.rank)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or type(err).__name__
            raise InputError(ARGS, f"--set {key}", f"the value {text!r} is not YAML: {problem}") from None
        node: Any = out
        loc: list[int | str] = []
        for i, part in enumerate(parts):
            where = ".".join(parts[:i])
            if isinstance(node, dict):
                slot: int | str = part
                if part not in node and part.isdigit() and int(part) in node:
                    slot = int(part)  # a YAML integer key (histogram lengths)
                if i == len(parts) - 1:
                    node[slot] = value
                elif node.get(slot) is None:
                    node[slot] = {}
            elif isinstance(node, list):
                slot = _list_slot(node, part, key, where)
                if i == len(parts) - 1:
                    node[slot] = value
            else:
                raise InputError(
                    ARGS,
                    f"--set {key}",
                    f"{where} is {describe_value(node)}, not a mapping or a list: it has no {part!r}",
                )
            loc.append(slot)
            node = node[slot]
        applied.append(_Override(item=item, key=key, loc=tuple(loc)))
    return out, tuple(applied)


def _list_slot(items: list, part: str, key: str, where: str) -> int:
    """The index of the list item ``part`` names: the item whose ``name`` it is, else its index."""
    names = [str(e["name"]) for e in items if isinstance(e, dict) and "name" in e]
    for i, e in enumerate(items):
        if isinstance(e, dict) and str(e.get("name")) == part:
            return i
    if part.isdigit() and int(part) < len(items):
        return int(part)
    span = f"an index 0..{len(items) - 1}" if items else "no index (the list is empty)"
    what = "task" if where == "tasks" else "item"
    if names and part.isdigit():
        msg = f"no {what} named {part!r} in {where}, and {where} has {span.removeprefix('an ')} only"
    elif names:
        msg = f"no {what} named {part!r} in {where}; name one of {', '.join(names)} or use {span}"
    else:
        msg = f"{where} is a list: address an item by {span}, not {part!r}"
    raise InputError(ARGS, f"--set {key}", msg)


def _effective_locs(override: _Override, raw: dict) -> list[tuple[int | str, ...]]:
    """Where an override decides a value of the validated spec: its own place, or for ``defaults.X``
    the ``tasks[i].X`` of every task that does not set X itself (the defaults merge rule)."""
    if override.loc[:1] != ("defaults",) or len(override.loc) < 2:
        return [override.loc]
    sub = override.loc[1:]
    tasks = raw.get("tasks")
    locs = []
    for i, task in enumerate(tasks if isinstance(tasks, list) else ()):
        node = task
        for part in sub:
            if not isinstance(node, dict):
                break
            if part not in node:
                locs.append(("tasks", i, *sub))
                break
            node = node[part]
    return locs


def _within(field: str, prefix: str) -> str | None:
    """The rest of ``field`` below ``prefix`` (``""`` when equal), or None when it is not below it."""
    if field == prefix:
        return ""
    if prefix and field.startswith(prefix) and field[len(prefix)] in ".[":
        return field[len(prefix) :]
    return None


def _blame_overrides(error: InputError, raw: dict, applied: tuple[_Override, ...]) -> InputError:
    """The file's error, said of the ``--set`` item it came from: an error inside a value an override
    set names ``<args>: --set KEY``; one about a mapping holding such a value says it is with the item."""
    if error.path == ARGS or not applied:
        return error
    around = []
    for override in reversed(applied):  # the last item setting a value is the one that stands
        for loc in _effective_locs(override, raw):
            rest = _within(error.field, format_validation_loc(loc))
            if rest is not None:
                return InputError(ARGS, f"--set {override.key}{rest}", error.msg)
            if _within(format_validation_loc(loc), error.field) is not None or not error.field:
                around.append(override.item)
                break
    if not around:
        return error
    return InputError(error.path, error.field, f"{error.msg} (with --set {', --set '.join(reversed(around))})")


def _given_distribution(spec: LengthSpec, ctx: int, source: tuple[str, str]) -> LengthDistribution:
    """The raw distribution a task's ``lengths`` gives without reading a dataset."""
    if spec.preset is not None:
        return preset_distribution(find_preset(spec.preset))
    if spec.mean is not None:
        try:
            return LengthDistribution.from_moments(spec.mean, spec.skewness, spec.kurtosis, ctx)
        except ValueError as err:
            raise InputError(source[0], f"{source[1]}.lengths", str(err)) from None
    if spec.values is not None:
        return LengthDistribution.from_samples(np.asarray(spec.values))
    assert spec.histogram is not None, "a dataset's lengths are read by resolve_workload"
    return LengthDistribution.from_histogram(spec.histogram)


def reads_dataset(spec: LengthSpec | None) -> bool:
    """A task's lengths are its rows' token lengths: of its training data (no ``lengths``) or of
    ``lengths.dataset``. These are the lengths that cost a tokenization to resolve."""
    return spec is None or spec.dataset is not None


def length_histogram(values: Sequence[int] | np.ndarray) -> dict[int, int]:
    """``{length: rows}`` of token lengths ``values``: ``LengthDistribution.from_histogram`` of it is
    ``from_samples(values)`` bit for bit (the same counts over the same total, in float64)."""
    lengths, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return dict(zip(lengths.tolist(), counts.tolist(), strict=True))


def _dataset_histogram(data: DataSpec, workload: WorkloadSpec, tokenizer: Callable[[], Any]) -> dict[int, int]:
    """The token-length histogram of every row of ``data``, tokenized as training will tokenize them (by
    ``tokenizer()``), or as a tokenization of the same bytes by the same tokenizer left it (``data.length_cache``:
    then no tokenizer is loaded; a tokenization here is kept there, for the ranks that train on the data)."""
    from lorafleet.data.length_cache import cached_lengths
    from lorafleet.data.records import read_task_rows
    from lorafleet.data.tokenize import Example, tokenize_task_rows

    def tokenized() -> list[Example]:
        rows = read_task_rows(data)
        if not rows.units:
            raise InputError(rows.source, "", "dataset has no rows")
        return tokenize_task_rows(tokenizer(), rows, data)

    return length_histogram(cached_lengths(data, workload.model, workload.tokenizer, tokenized))


def resolve_workload_paths(spec: WorkloadSpec, base: Path) -> WorkloadSpec:
    """``spec`` with every path it names resolved against ``base`` (``specs.workload.resolve_path``): its
    tasks' data (``resolve_data_paths``), its tokenizer, its pools' profiles, and its model when that is not
    a preset and names something that exists under ``base``. The one list of a workload's paths: against its
    file's folder when it is loaded, against the working directory when the run writes it resolved."""
    top: dict = {"tasks": tuple(resolve_data_paths(task, base) for task in spec.tasks)}
    if any(p.profile is not None for p in spec.cluster.pools):
        pools = tuple(
            p.model_copy(update={"profile": resolve_path(p.profile, base)}) if p.profile is not None else p
            for p in spec.cluster.pools
        )
        top["cluster"] = spec.cluster.model_copy(update={"pools": pools})
    if spec.tokenizer is not None:
        top["tokenizer"] = resolve_path(spec.tokenizer, base)
    if spec.model not in MODEL_PRESETS and (base / spec.model).exists():
        top["model"] = resolve_path(spec.model, base)
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


def load_workload(path: str | Path, overrides: Sequence[str] | None = None) -> Workload:
    """Read, validate and resolve a workload file; every problem is an InputError. ``overrides`` are
    ``--set KEY=VALUE`` items applied to the file's mapping before validation (:func:`apply_overrides`);
    values they set are taken as if written in the file (paths relative to it), and an error in one is
    said of its ``--set`` item."""
    path = str(path)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise InputError(path, "", f"expected a mapping with a 'tasks' list, got {type(raw).__name__}")
    raw, applied = _apply_overrides(raw, overrides or ())
    try:
        spec = WorkloadSpec.model_validate(raw)
    except ValidationError as err:
        error = InputError(path, *describe_validation_error(err.errors()[0]))
        raise _blame_overrides(error, raw, applied) from None
    try:
        return resolve_workload(resolve_workload_paths(spec, Path(path).parent), path)
    except InputError as err:
        raise _blame_overrides(err, raw, applied) from None


def resolve_workload(spec: WorkloadSpec, path: str, known: Mapping[str, Mapping[int, int]] | None = None) -> Workload:
    """Resolve a validated spec (paths already absolute or relative to the cwd); ``path`` names it in errors.
    ``known``: the token-length histograms of tasks whose lengths read a dataset (:func:`reads_dataset`),
    tokenized already (a run file's, a queued task's data), by task name: taken as they are, so no data is
    tokenized again for them."""
    from lorafleet.data.model_source import data_tokenizer

    model = resolve_model(spec.model, str(path), "model")
    known = known or {}
    tokenizer = functools.cache(lambda: data_tokenizer(spec.model, spec.tokenizer, source=str(path)))  # once, if at all
    tasks = []
    for i, task in enumerate(spec.tasks):
        where = (str(path), f"tasks[{i}]")
        try:  # the targets name projections this model has (Phi-3's are fused: specs.architecture)
            model_targets(task.lora.target_modules, model.model_type)
        except ValueError as err:
            raise InputError(str(path), f"tasks[{i}].lora.target_modules", str(err)) from None
        histogram = None
        if reads_dataset(task.lengths):
            histogram = known.get(task.name)
            if histogram is None:
                histogram = _dataset_histogram(task.lengths.dataset if task.lengths else task.data, spec, tokenizer)
            raw = LengthDistribution.from_histogram(histogram)
        else:
            raw = _given_distribution(task.lengths, task.context_length, where)
        lengths, overflow = apply_overflow(raw, task.context_length, task.overflow, where)
        tasks.append(Task(task, raw, lengths, overflow, histogram))
    return Workload(path=str(path), spec=spec, model=model, tasks=tuple(tasks))
