"""A task's hyperparameter sweep (its ``sweep`` key): the member tasks it expands into, trained side by side.

Example::

    - name: support-bot
      data: {path: support.jsonl, format: messages}
      eval: {split: 0.05, every_steps: 20}
      sweep:
        grid: {optimizer.lr: [1e-4, 3e-4, 1e-3], lora.rank: [8, 16, 32]}
        halving: {eta: 3, rung_steps: 20}

**Members.** A ``grid`` expands into the Cartesian product of its keys' values, in the order written (the last key
varies fastest); ``random: {n, seed, space}`` draws ``n`` members, each key from a list of choices or a range
``{low, high, log}`` (a whole-number key, such as ``lora.rank``, rounds its draw). A member is the task with its
values set, named ``<task>.<key>=<value>...`` (a key by its last part, ``lr`` and ``rank``; the whole key where
two keys share one), and validated like any task; the sweep's own name names no task.

**What may be swept** is what changes only the adapter or its optimizer: any key of ``lora`` or ``optimizer``.
Every member then shares the task's data, its tokenization, its held-out rows and its data order
(:attr:`TaskSpec.seed_name`): the members see the same batches at the same steps, and the sweep is a controlled
experiment. A key that changes the data (``batch_size``, ``context_length``, ``data``, ``steps``) is refused: sweep
it as separate tasks.

**Successive halving** (``halving``, needs ``eval``): at each rung, after every ``rung_steps`` of the members'
own steps, the best ``max(1, floor(n / eta))`` of the ``n`` members still training go on and the others leave the
run at that boundary (``lorafleet.sweeps``). **A rung is judged by an evaluation at its boundary**, whatever
``eval.every_steps`` is: the members still training are evaluated after their own step ``k rung_steps`` as after a
multiple of ``every_steps`` (an evaluation like any other: it counts for the best adapter, early stopping's patience,
the metrics rows and the accounting), for the ``R`` rungs a sweep of ``N`` members can decide (the halvings that take
``N`` to one, ``R = min {k : keep^k(N) = 1}``; none after: the survivor is evaluated on ``every_steps`` alone). So
``rung_steps`` need not be a multiple of ``every_steps``: rungs every 20 steps and evaluations every 100 (or only at
the end, ``every_steps`` = ``steps``) is a sweep. The schedule is one pure function of the member's spec and its own
step (``lorafleet.eval_schedule``), which ``train``, ``simulate`` and ``sweep-report`` all read.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field, ValidationError, model_validator

from lorafleet.specs._base import Bool, FieldError, Float, Int, Spec
from lorafleet.specs.lora import LoraSpec, OptimizerSpec
from lorafleet.specs.names import task_name_error

MEMBERS_DIR = "members"
"""Where a sweep's members' adapters are exported: ``adapters/<sweep>/members/<member>/``."""
MAX_MEMBERS = 256
"""The most members one sweep expands into."""

SWEEPABLE: dict[str, type[Spec]] = {"lora": LoraSpec, "optimizer": OptimizerSpec}
"""The task keys whose fields a sweep may set: those that change only the adapter or its optimizer."""


class HalvingSpec(Spec):
    """Successive halving of a sweep's members (module doc)."""

    eta: Int = Field(3, ge=2, le=MAX_MEMBERS)
    """Each rung keeps the best ``max(1, floor(n / eta))`` of its ``n`` members."""
    rung_steps: Int = Field(ge=1, le=1_000_000)
    """The members' own steps between two rungs (any number: each rung boundary is evaluated, module doc)."""


class RangeSpec(Spec):
    """A range a random sweep draws one key's values from: uniform in ``[low, high]``, or in its logarithm."""

    low: Float
    high: Float
    log: Bool = False
    """Draw uniformly in ``log`` space (a learning rate's usual prior); needs ``low > 0``."""

    @model_validator(mode="after")
    def _ordered(self) -> RangeSpec:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) is below low ({self.low})")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self


class RandomSpec(Spec):
    """A random sweep: ``n`` members, each key drawn independently (module doc)."""

    n: Int = Field(ge=1, le=MAX_MEMBERS)
    seed: Int = Field(0, ge=0)
    """Seed of the draws (with the task's name): the same members on every machine and resume."""
    space: dict[str, RangeSpec | list[Any]] = Field(min_length=1)
    """Per key, its choices or its range."""


class SweepSpec(Spec):
    """A task's sweep (module doc): set exactly one of ``grid`` and ``random``."""

    grid: dict[str, list[Any]] | None = None
    """Per key, its values; the members are their product."""
    random: RandomSpec | None = None
    halving: HalvingSpec | None = None
    keep_members: Bool = True
    """Keep every member's adapter under ``adapters/<task>/members/`` (else only the winner's, promoted to
    ``adapters/<task>/``)."""

    @model_validator(mode="after")
    def _one_kind(self) -> SweepSpec:
        if (self.grid is None) == (self.random is None):
            raise ValueError("set exactly one of grid and random")
        if self.grid is not None:
            if not self.grid:
                raise FieldError(("grid",), "is empty: name at least one key and its values")
            for key, values in self.grid.items():
                if not values:
                    raise FieldError(("grid", key), "has no value")
        return self


class SweepMembership(Spec):
    """What makes a task a sweep's member (set by the expansion, never written by hand)."""

    sweep: str
    """The sweep's name: the task that carried it."""
    index: Int = Field(ge=0)
    """The member's place in the sweep's order (ties are settled by it: ``lorafleet.sweeps``)."""
    values: tuple[tuple[str, Any], ...]
    """Its swept keys and values, in the sweep's key order (pairs: a file written with sorted keys keeps it)."""
    halving: HalvingSpec | None = None
    keep_members: Bool = True
    members: Int | None = Field(None, ge=1, le=MAX_MEMBERS)
    """How many members the sweep expanded into: with ``halving.eta``, the rungs it can decide (module doc; None in
    a membership recorded before it was kept: every rung boundary is evaluated)."""


def sweep_members(raw: Mapping[str, Any], where: tuple[int | str, ...] = ("sweep",)) -> list[dict[str, Any]]:
    """The member tasks (raw mappings) of the task ``raw`` with a ``sweep``; FieldError located under ``where``."""
    try:
        spec = SweepSpec.model_validate(raw["sweep"])
    except ValidationError as error:
        first = error.errors()[0]
        cause = first.get("ctx", {}).get("error")
        loc = tuple(first["loc"]) + (cause.loc if isinstance(cause, FieldError) else ())
        raise FieldError(where + loc, first["msg"].removeprefix("Value error, ")) from None
    name = str(raw.get("name", ""))
    if spec.halving is not None and not isinstance(raw.get("eval"), dict):
        raise FieldError(where + ("halving",), "successive halving needs an eval (eval: {split: 0.05})")
    axes = _axes(spec, name, raw, where)
    if len(axes) > MAX_MEMBERS:
        raise FieldError(where, f"expands into {len(axes)} members; at most {MAX_MEMBERS}")
    short = _short_keys([key for key in axes[0]])
    members: list[dict[str, Any]] = []
    named: dict[str, int] = {}
    base = {k: v for k, v in raw.items() if k != "sweep"}
    for index, values in enumerate(axes):
        member = copy.deepcopy(base)
        for key, value in values.items():
            head, field = key.split(".", 1)
            member[head] = {**(member.get(head) or {}), field: value}
        label = ".".join(f"{short[key]}={value_label(value)}" for key, value in values.items())
        member["name"] = f"{name}.{label}"
        if (error := task_name_error(member["name"])) is not None:
            raise FieldError(where, f"member {index + 1}: {error}")
        if member["name"] in named:
            raise FieldError(
                where, f"members {named[member['name']] + 1} and {index + 1} are both named {member['name']!r}"
            )
        named[member["name"]] = index
        member["member_of"] = {
            "sweep": name,
            "index": index,
            "values": list(values.items()),
            "halving": spec.halving.model_dump() if spec.halving else None,
            "keep_members": spec.keep_members,
            "members": len(axes),
        }
        members.append(member)
    return members


def _axes(spec: SweepSpec, name: str, raw: Mapping[str, Any], where: tuple) -> list[dict[str, Any]]:
    """Each member's values, in order: the grid's product, or the random draws (each value checked by its key's
    spec, merged over the task's own settings)."""
    if spec.grid is not None:
        for key, values in spec.grid.items():
            for value in values:
                _check_value(key, value, raw, where + ("grid", key))
        keys = list(spec.grid)
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*spec.grid.values())]
    assert spec.random is not None
    space = spec.random.space
    rng = np.random.default_rng(np.random.SeedSequence([spec.random.seed, *name.encode()]))
    members = []
    for _ in range(spec.random.n):
        values = {}
        for key, choices in space.items():
            whole = isinstance(_default(key, where + ("random", "space", key)), int)
            if isinstance(choices, RangeSpec):
                scale = math.log if choices.log else float
                draw = float(rng.uniform(scale(choices.low), scale(choices.high)))
                value: Any = math.exp(draw) if choices.log else draw
                value = round(value) if whole else float(f"{value:.4g}")
            else:
                if not choices:
                    raise FieldError(where + ("random", "space", key), "has no value")
                value = choices[int(rng.integers(len(choices)))]
            values[key] = value
        for key, value in values.items():
            _check_value(key, value, raw, where + ("random", "space", key))
        members.append(values)
    return members


def _default(key: str, where: tuple) -> Any:
    """The default of a sweepable key; FieldError naming what can be swept when ``key`` is not one."""
    head, _, field = key.partition(".")
    spec = SWEEPABLE.get(head)
    if spec is not None and field in spec.model_fields:
        return spec.model_fields[field].default
    keys = ", ".join(f"{h}.{f}" for h, s in SWEEPABLE.items() for f in s.model_fields)
    if head in DATA_KEYS:
        why = "it changes the task's data or its run, not only its adapter (sweep it as separate tasks)"
    else:
        why = "no such key"
    raise FieldError(where, f"{key!r} cannot be swept: {why}; sweepable keys: {keys}")


DATA_KEYS = ("batch_size", "context_length", "data", "steps", "epochs", "overflow", "share", "deadline", "eval",
             "early_stopping", "lengths", "preset", "start_step", "name")  # fmt: skip
"""Task keys a sweep refuses by name: they change the data a task trains on, or its run."""


def _check_value(key: str, value: Any, raw: Mapping[str, Any], where: tuple) -> None:
    """FieldError at ``where`` unless ``value`` is a valid ``key`` for this task."""
    _default(key, where)
    head, field = key.split(".", 1)
    own = raw.get(head) if isinstance(raw.get(head), dict) else {}
    try:
        SWEEPABLE[head].model_validate({**own, field: value})
    except ValidationError as error:
        first = error.errors()[0]
        raise FieldError(where, f"value {value!r}: {first['msg'].removeprefix('Value error, ')}") from None


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each key's label in a member's name: its last part, or the whole key where two keys share one."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last, strict=True)}


def value_label(value: Any) -> str:
    """A swept value as a member's name writes it: ``3e-4``, ``16``, ``0.05``, ``true``, ``q_proj-v_proj``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != 0 and not 1e-2 <= abs(value) < 1e5:
            mantissa, exponent = f"{value:.6e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "-".join(value_label(v) for v in value)
    return str(value)
