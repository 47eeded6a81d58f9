"""What a resume may not change silently: the training hyperparameters of the tasks it continues.

A resume continues the run's tasks as they were trained. Each task's spec now (the workload file with
its ``--set`` overrides) is compared, field by field, with the spec the run last trained it by: the task
ledger's (``tasks.json``) when the run has one, else ``<out>/workload.resolved.yaml``'s. Left out of the
comparison:

- ``data``: its content is checked by fingerprint against the checkpoint, so a moved file is no change;
- ``start_step`` and tasks the queue added (the file does not have them);
- a task's ``share`` and ``deadline`` once a queued update changed them (the ledger's are the run's).

Any other difference (a learning rate, a LoRA rank, a batch size, a schedule) is refused with one line
naming the field, unless ``--allow-changes``: then the run trains on with the new values from the step
it resumes at, and each change is recorded with that step as a :class:`Revision`, in the ledger (each
entry's ``revisions``), at the top of ``workload.resolved.yaml`` (comments: the file holds the values
in force now) and in each exported adapter's card. The file plus its recorded revisions is the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import JsonValue, with_config
from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing only on Python >= 3.12

from lorafleet.errors import InputError
from lorafleet.specs._base import Int
from lorafleet.specs.field_docs import documented
from lorafleet.specs.workload import TaskSpec

IGNORED = frozenset({"data", "start_step", "name"})
"""Task fields a resume may change (module doc)."""
QUEUED = frozenset({"share", "deadline"})
"""Task fields the queue changes (left out for a task whose ledger entry has queued changes)."""


@with_config(documented(extra="forbid"))
class Revision(TypedDict):
    """One hyperparameter of a task changed on a resume (``--allow-changes``)."""

    step: Int
    """The first step trained with the new value."""
    field: str
    """Its dotted path in the task's spec (``optimizer.lr``)."""
    before: JsonValue
    after: JsonValue


def describe(revision: Revision) -> str:
    """``optimizer.lr 0.001 -> 0.005 from step 4``."""
    return f"{revision['field']} {revision['before']} -> {revision['after']} from step {revision['step']}"


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            yield from _leaves(inner, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def task_revisions(before: TaskSpec, after: TaskSpec, step: int, queued: bool = False) -> list[Revision]:
    """The fields of task ``after`` that differ from ``before`` (module doc), as revisions from ``step``."""
    left_out = IGNORED | (QUEUED if queued else frozenset())
    old = dict(_leaves(before.model_dump(mode="json", exclude=set(left_out))))
    new = dict(_leaves(after.model_dump(mode="json", exclude=set(left_out))))
    return [
        Revision(step=step, field=key, before=old.get(key), after=new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]


def resume_revisions(
    now: Sequence[TaskSpec],
    trained: Sequence[TaskSpec],
    step: int,
    source: str,
    allowed: bool,
    queued: frozenset[str] = frozenset(),
) -> dict[str, list[Revision]]:
    """Per task of both ``now`` (the workload file's) and ``trained`` (the run's), its revisions at the resumed
    ``step``; ``queued``: tasks whose share or deadline the queue changed. InputError naming the first changed
    field of ``source`` (the workload file) unless ``allowed``."""
    by_name = {t.name: t for t in trained}
    found = {
        t.name: revisions
        for t in now
        if t.name in by_name and (revisions := task_revisions(by_name[t.name], t, step, t.name in queued))
    }
    if found and not allowed:
        name, revisions = next(iter(found.items()))
        first = revisions[0]
        more = sum(len(r) for r in found.values()) - 1
        also = f" (and {more} more)" if more else ""
        raise InputError(
            source,
            f"tasks.{name}.{first['field']}",
            f"{first['after']} now, {first['before']} in the run being resumed{also}; a resume trains on as the run "
            f"did: pass --allow-changes to train with the new values from step {step} on",
        )
    return found


def revised(
    trained: Sequence[TaskSpec], now: Sequence[TaskSpec], revisions: Mapping[str, Sequence[Revision]]
) -> list[TaskSpec]:
    """The ``trained`` specs with each revised task's changed fields (their top-level keys) taken from ``now``."""
    by_name = {t.name: t for t in now}
    out = []
    for spec in trained:
        keys = {r["field"].split(".")[0] for r in revisions.get(spec.name, ())}
        out.append(spec.model_copy(update={k: getattr(by_name[spec.name], k) for k in keys}) if keys else spec)
    return out


def resolved_header(revisions: Mapping[str, Sequence[Revision]]) -> str:
    """The comment block ``workload.resolved.yaml`` starts with when a resume changed hyperparameters."""
    if not any(revisions.values()):
        return ""
    lines = ["# Changed on resume (--allow-changes); the values below are those in force from each step on:"]
    lines += [f"#   tasks.{name}.{describe(r)}" for name, rs in revisions.items() for r in rs]
    return "\n".join(lines) + "\n"


def trained_specs(out: Path, ledger_active: Sequence[TaskSpec] | None) -> tuple[TaskSpec, ...] | None:
    """The task specs the run in ``out`` last trained by: the ledger's active ones, else those of its
    ``workload.resolved.yaml``; None when it has neither (nothing to compare)."""
    if ledger_active is not None:
        return tuple(ledger_active)
    from lorafleet.rundir import RunDir
    from lorafleet.specs.workload import WorkloadSpec
    from lorafleet.workload import read_yaml

    path = RunDir(out).resolved_workload
    if not path.is_file():
        return None
    return WorkloadSpec.model_validate(read_yaml(path)).tasks  # the run's own file, as written; no data is read
