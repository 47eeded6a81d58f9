"""A task's held-out rows: the deterministic split of its data into training and evaluation rows.

**The split** (``eval: {split: f}``). Each distinct row (its tokens and labels) gets a 64-bit key,

    h(row) = SHA-256(name ‖ input_ids ‖ labels)[:8],

seeded by the task's *name* only (not the run's seed: a sweep over seeds evaluates on the same rows; a sweep's
members, by the sweep's name: ``TaskSpec.seed_name``). The
``round(f · D)`` distinct rows of lowest key (``D`` distinct rows, half rounded up) are held out, with every copy
of each; the others train. So a row's side depends on its content, never on its position or the rows beside it:
the same rows whatever the file's order, a duplicated row never on both sides, and a row appended to the file
moves at most one other row across (the one at the margin of the count). An evaluation reads the first
``max_rows`` held-out rows in key order.

**A held-out file** (``eval: {data: ...}``) is read and tokenized like the task's data; the task trains on all its
own rows.

A split that leaves no row on a side, or held-out rows with nothing to evaluate after the task's overflow rule, is
an InputError naming the task's file and field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from lorafleet.data.tokenize import Example
from lorafleet.data.workload_tokens import WorkloadTokens
from lorafleet.errors import InputError
from lorafleet.specs.workload import TaskSpec


def row_key(name: str, example: Example) -> int:
    """``h(row)`` of the module doc: 64 bits of SHA-256 over the task's name and the row's tokens and labels."""
    digest = hashlib.sha256(name.encode())
    digest.update(np.asarray(example.input_ids, dtype=np.int64).tobytes())
    digest.update(np.asarray(example.labels, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest()[:8], "little")


def split_rows(name: str, examples: Sequence[Example], fraction: float) -> tuple[list[int], list[int]]:
    """The indices of ``examples`` that train and those held out (in key order), by the module doc's rule."""
    keys = [row_key(name, e) for e in examples]
    distinct = sorted(set(keys))
    held = set(distinct[: int(fraction * len(distinct) + 0.5)])
    train = [i for i, k in enumerate(keys) if k not in held]
    held_out = sorted((i for i, k in enumerate(keys) if k in held), key=lambda i: (keys[i], i))
    return train, held_out


def held_out_examples(
    task: TaskSpec, examples: Sequence[Example], tokens: WorkloadTokens
) -> tuple[list[Example], list[Example]]:
    """``task``'s training examples and its held-out ones (at most ``eval.max_rows``), before the overflow rule;
    ``examples`` (its own data's) all train when it has no eval or a held-out file. InputError naming the task's
    file and field when a side is empty. A held-out file is tokenized by ``tokens`` (or read from its cache)."""
    spec = task.eval
    if spec is None:
        return list(examples), []
    assert task.data is not None
    if spec.data is not None:
        held = tokens.examples(spec.data)
        if not held:
            raise InputError(spec.data.path, "", f"task {task.name!r}'s eval data has no row")
        return list(examples), held[: spec.max_rows]
    assert spec.split is not None
    train, held = split_rows(task.seed_name, examples, spec.split)
    if not held or not train:
        side = "no held-out row" if not held else "no training row"
        raise InputError(
            task.data.path,
            f"tasks.{task.name}.eval.split",
            f"split {spec.split} of {len(examples)} rows leaves {side}: "
            + ("raise it, or give eval: {data: ...}" if not held else "lower it"),
        )
    return [examples[i] for i in train], [examples[i] for i in held[: spec.max_rows]]
