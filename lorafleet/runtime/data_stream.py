"""Each task's examples as an endless, deterministic, resumable stream; global batches from it.

**Stream.** Task ``t`` with ``N`` examples is read epoch by epoch; epoch ``e`` visits the
examples in the order of a permutation drawn from ``(seed, key_t, e)``, ``key_t`` a hash of the
task's *name* (:func:`task_key`), not of its position: a task's stream is the same whichever
tasks train beside it, join or leave. Stream position ``k`` (the *sample id*) is therefore

    example(t, k) = perm(seed, key_t, k // N)[k mod N]

a pure function: any rank can look up any sample without state, and a sample id in a
:class:`~lorafleet.plans.GlobalBatch` names one example on every machine.

**Cursor.** Per task, the next sample id: ``taken_t(s) * batch_size_t`` before step ``s``, with
``taken_t(s)`` the global batches it took part in before ``s``. Which steps those are is
:func:`lorafleet.turns.turns` of the tasks' joins, ends, shares and deadlines (by
default: every step from the task's join until it has taken its ``max_batches_t``), a pure
function of the task list, so the global batch of any step is a pure function of the step: a
dispatcher may draw step ``s + 1`` ahead while step ``s`` runs, and a resumed run draws exactly
the batches the uninterrupted one would have. A checkpoint records the cursors, and a resume
checks that the data still yields them (:meth:`DataStreams.check_state`).

**Overflow.** Examples longer than the task's context length are truncated or rejected by
its policy when the data is prepared (:func:`prepare_task_data`); examples with no token to
learn (every label ignored after the shift) are dropped too. Both counts are kept, and each
global batch counts how many of its sequences were truncated.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from lorafleet.data.model_source import data_tokenizer
from lorafleet.data.tokenize import IGNORE_INDEX, Example
from lorafleet.data.workload_tokens import WorkloadTokens
from lorafleet.errors import InputError
from lorafleet.plans import GlobalBatch
from lorafleet.runtime.eval_split import held_out_examples
from lorafleet.specs.workload import OverflowPolicy, TaskSpec, WorkloadSpec, fit_to_context
from lorafleet.turns import TaskTurns, last_step, turns


def loss_tokens(example: Example) -> int:
    """Tokens the causal LM is trained to predict: positions ``i >= 1`` with a label (the shift)."""
    return sum(1 for label in example.labels[1:] if label != IGNORE_INDEX)


@dataclass(frozen=True)
class TaskData:
    """One task's training examples after its overflow policy."""

    name: str
    examples: tuple[Example, ...]
    truncated_ids: frozenset[int] = frozenset()
    """Indices (into ``examples``) of examples cut to the context length."""
    rejected: int = 0
    """Examples dropped for exceeding the context length (``reject`` policy)."""
    no_target: int = 0
    """Examples dropped because no token of theirs carries a label."""
    raw_lengths: tuple[int, ...] = ()
    """Every training row's token length before the overflow rule, when known (:func:`prepare_task_data`): the
    lengths the planner reads from the task's data (``workload``), so a task added to a running fleet is tokenized
    once."""
    eval_examples: tuple[Example, ...] = ()
    """The held-out rows an evaluation reads (``runtime.eval_split``), after the overflow rule; none without an
    ``eval``. Not in :attr:`fingerprint`: what a resume checks is the training data."""
    order_name: str | None = None
    """The name its data order is drawn by (``TaskSpec.seed_name``: a sweep's members share their sweep's); None:
    its own."""

    def __post_init__(self) -> None:
        if not self.examples:
            raise ValueError(f"task {self.name!r} has no example to train on")

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 (16 hex digits) of every example's tokens and labels, in order: what a resume checks the
        data by (a changed row, tokenizer or overflow policy changes it)."""
        digest = hashlib.sha256()
        for example in self.examples:
            digest.update(np.asarray(example.input_ids, dtype=np.int64).tobytes())
            digest.update(np.asarray(example.labels, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]


def apply_overflow(name: str, examples: Sequence[Example], context_length: int, policy: OverflowPolicy) -> TaskData:
    """Truncate or reject examples over ``context_length`` (the overflow rule, ``fit_to_context``); drop those
    with nothing to learn."""
    kept: list[Example] = []
    truncated: set[int] = set()
    rejected = no_target = 0
    fit = fit_to_context([len(e) for e in examples], context_length, policy)
    for example, length, cut, dropped in zip(
        examples, fit.lengths.tolist(), fit.truncated.tolist(), fit.rejected.tolist(), strict=True
    ):
        if dropped:
            rejected += 1
            continue
        example = example.truncated(length) if cut else example
        if loss_tokens(example) == 0:
            no_target += 1
            continue
        if cut:
            truncated.add(len(kept))
        kept.append(example)
    return TaskData(name, tuple(kept), frozenset(truncated), rejected, no_target, tuple(len(e) for e in examples))


def prepare_task_data(task: TaskSpec, tokens: WorkloadTokens | Any, source: str) -> TaskData:
    """Read, tokenize and apply the overflow policy to a task's ``data``, its held-out rows split off or read
    (``runtime.eval_split``); InputError when unusable. ``tokens``: the workload's (:func:`workload_tokens`: data
    tokenized before is read from the token cache), or a tokenizer (every dataset tokenized)."""
    if task.data is None:
        raise InputError(source, f"tasks.{task.name}.data", "training needs data (a JSONL file or a saved dataset)")
    tokens = WorkloadTokens.of(tokens)
    examples = tokens.examples(task.data)
    examples, held_out = held_out_examples(task, examples, tokens)
    try:
        data = apply_overflow(task.name, examples, task.context_length, task.overflow)
    except ValueError:
        raise InputError(
            task.data.path,
            "",
            f"no row is left to train on after overflow={task.overflow.value} at context_length={task.context_length}",
        ) from None
    data = replace(data, order_name=task.seed_name)
    if not held_out:
        return data
    try:
        evaluated = apply_overflow(task.name, held_out, task.context_length, task.overflow).examples
    except ValueError:
        where = task.eval.data.path if task.eval is not None and task.eval.data is not None else task.data.path
        raise InputError(
            where, "", f"task {task.name!r} has no held-out row to evaluate on after overflow={task.overflow.value}"
        ) from None
    return replace(data, eval_examples=evaluated)


def task_key(seed: int, name: str) -> int:
    """A task's own seed: 63 bits of SHA-256 over ``(seed, name)``. Its data order and its adapter's
    initial weights are drawn from it, so they depend on the task, never on the tasks beside it."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@lru_cache(maxsize=64)
def _epoch_order(seed: int, key: int, epoch: int, n: int) -> np.ndarray:
    """The visiting order of one task's ``n`` examples in one epoch (read-only)."""
    order = np.random.default_rng(np.random.SeedSequence([seed, key, epoch])).permutation(n)
    order.setflags(write=False)
    return order


@dataclass(frozen=True)
class TaskStream:
    """Sample id -> example of one task (stateless; see the module doc)."""

    data: TaskData
    seed: int

    @functools.cached_property
    def key(self) -> int:
        return task_key(self.seed, self.data.order_name or self.data.name)

    def example_index(self, sample_id: int) -> int:
        n = len(self.data.examples)
        return int(_epoch_order(self.seed, self.key, sample_id // n, n)[sample_id % n])

    @functools.cached_property
    def batch_tokens(self) -> float:
        """Mean tokens of one example (times a batch size: a batch's expected tokens, for shares)."""
        return float(np.mean([len(e) for e in self.data.examples]))

    def example(self, sample_id: int) -> Example:
        return self.data.examples[self.example_index(sample_id)]


class DataStreams:
    """Every task's stream: the global batch of any step, and the cursors to check a resume by."""

    def __init__(
        self,
        tasks: Sequence[TaskData],
        batch_sizes: Sequence[int],
        seed: int,
        max_batches: Sequence[int | None] | None = None,
        *,
        joined: Sequence[int] | None = None,
        shares: Sequence[float | None] | None = None,
        deadlines: Sequence[int | None] | None = None,
        changes: Sequence[tuple[tuple[int, float | None, int | None], ...]] | None = None,
        departed: Sequence[TaskTurns] = (),
    ) -> None:
        """
        Args:
            tasks: per task, in workload order (the task index is the position).
            batch_sizes: sequences of each task in every global batch it takes part in.
            seed: seed of the epoch permutations.
            max_batches: per task, how many global batches it takes part in (its ``steps``);
                None for no limit.
            joined: per task, the first global step it takes part in (a task that joined a running
                job); 0 for all by default.
            shares: per task, its target fraction of every step's tokens (None: every step).
            deadlines: per task, the global step by which its last batch must be taken.
            changes: per task, its share and deadline changed while the job ran (``TaskTurns.changes``).
            departed: the turns of tasks that have left the job (finished, cancelled): a share's turns
                depend on every task a step took, so the steps before they left are drawn as they were.
        """
        if len(batch_sizes) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks but {len(batch_sizes)} batch sizes")
        n = len(tasks)
        self.seed = seed
        self.streams = tuple(TaskStream(data, seed) for data in tasks)
        self.batch_sizes = tuple(int(b) for b in batch_sizes)
        self.max_batches = tuple(max_batches) if max_batches is not None else (None,) * n
        self.turns = [
            TaskTurns(
                tokens=b * s.batch_tokens, batches=limit, joined=j, share=share, deadline=deadline, changes=history
            )
            for s, b, limit, j, share, deadline, history in zip(
                self.streams,
                self.batch_sizes,
                self.max_batches,
                joined or (0,) * n,
                shares or (None,) * n,
                deadlines or (None,) * n,
                changes or ((),) * n,
                strict=True,
            )
        ]
        self.departed = tuple(departed)
        self._taken = np.zeros((1, n), dtype=np.int64)
        """``_taken[s, t]``: global batches task ``t`` took part in before step ``s`` (grown on demand)."""

    @property
    def joined(self) -> tuple[int, ...]:
        return tuple(t.joined for t in self.turns)

    @property
    def retired(self) -> dict[int, int]:
        """Task index -> the first step whose batch leaves it out (stopped or finished)."""
        return {t: turn.until for t, turn in enumerate(self.turns) if turn.until is not None}

    def retire(self, task_index: int, from_step: int) -> None:
        """Leave task ``task_index`` out of the batches of ``from_step`` on. Keyed by step, not by when it
        is called, so a batch drawn ahead (look-ahead dispatch) is the same whenever it is drawn."""
        turn = self.turns[task_index]
        until = from_step if turn.until is None else min(turn.until, from_step)
        self.turns[task_index] = replace(turn, until=until)
        self._taken = self._taken[: until + 1]

    def _cumulative(self, step: int) -> np.ndarray:
        if step >= len(self._taken):
            horizon = max(step + 1, 2 * len(self._taken))
            took = turns([*self.turns, *self.departed], horizon - 1)[:, : len(self.turns)]
            self._taken = np.vstack([np.zeros((1, len(self.turns)), dtype=np.int64), np.cumsum(took, axis=0)])
        return self._taken[step]

    def batches_taken(self, task_index: int, step: int) -> int:
        """Global batches task ``task_index`` took part in before step ``step``."""
        return int(self._cumulative(step)[task_index])

    def end_step(self, horizon: int) -> int:
        """The step after the last one (within ``horizon``) any task takes part in."""
        return last_step(self.turns, horizon)

    def cursors(self, step: int) -> list[int]:
        """Per task, the next sample id before step ``step``."""
        return [int(n) * b for n, b in zip(self._cumulative(step), self.batch_sizes, strict=True)]

    def global_batch(self, step: int) -> GlobalBatch:
        """Step ``step``'s batch: each active task's next ``batch_size`` samples, grouped by task.

        Raises:
            StopIteration: every task has taken all its batches.
        """
        task_ids, sample_ids, lengths = [], [], []
        truncated = 0
        after = self._cumulative(step + 1)
        for t, (stream, start) in enumerate(zip(self.streams, self.cursors(step), strict=True)):
            if after[t] * self.batch_sizes[t] == start:
                continue  # not its turn: not joined yet, done, stopped, or its share skips this step
            for sample_id in range(start, start + self.batch_sizes[t]):
                index = stream.example_index(sample_id)
                truncated += index in stream.data.truncated_ids
                task_ids.append(t)
                sample_ids.append(sample_id)
                lengths.append(len(stream.data.examples[index]))
        if not task_ids:
            raise StopIteration(f"every task has taken all its batches before step {step}")
        return GlobalBatch(
            step=step,
            task_ids=np.asarray(task_ids, dtype=np.int64),
            sample_ids=np.asarray(sample_ids, dtype=np.int64),
            lengths=np.asarray(lengths, dtype=np.int64),
            truncated=truncated,
        )

    def examples(self, task_ids: Sequence[int], sample_ids: Sequence[int]) -> list[Example]:
        """The examples behind a batch's (task, sample id) pairs."""
        return [self.streams[int(t)].example(int(s)) for t, s in zip(task_ids, sample_ids, strict=True)]

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` completed steps records of the data, per task by name."""
        return {
            "step": step,
            "tasks": [s.data.name for s in self.streams],
            "cursors": self.cursors(step),
            "examples": [len(s.data.examples) for s in self.streams],
            "fingerprints": [s.data.fingerprint for s in self.streams],
        }

    def with_stops(self, stopped: Mapping[str, int]) -> DataStreams:
        """A copy of these streams with each task of ``stopped`` (name -> step) retired from its step on;
        the names this data lacks are ignored (they left the run)."""
        view = copy.copy(self)
        view.turns = list(self.turns)
        names = [s.data.name for s in self.streams]
        for name, step in stopped.items():
            if name in names:
                view.retire(names.index(name), int(step))
        return view

    def changed(
        self,
        tasks: Sequence[TaskSpec],
        prepare: Callable[[TaskSpec], TaskData],
        turn_changes: Mapping[str, tuple],
        departed: Sequence[TaskTurns],
        stopped: Mapping[str, int],
    ) -> DataStreams:
        """The streams of a running fleet whose tasks became ``tasks`` (in task order): each staying task keeps its
        prepared data (nothing is read or tokenized again), a new one's is ``prepare(spec)``, once per sweep
        (:func:`shared_data`); the turns are those a launch on the task ledger draws (``turn_changes`` and
        ``departed``: ``lorafleet.turns``), with the tasks of
        ``stopped`` (non-finite updates; name -> the first step left out) retired again."""
        data = shared_data(tasks, prepare, {s.data.name: s.data for s in self.streams})
        return task_streams(tasks, data, self.seed, turn_changes, departed).with_stops(stopped)

    def end_steps(self, horizon: int) -> dict[int, int]:
        """Per task with a bounded number of batches (not stopped) that takes its last one within ``horizon``
        steps: the step after that last one, when it is done."""
        self._cumulative(horizon)  # rows up to the horizon
        taken = self._taken[: horizon + 1]
        return {
            t: int(np.searchsorted(taken[:, t], limit))
            for t, limit in enumerate(self.max_batches)
            if limit is not None and t not in self.retired and taken[-1, t] >= limit
        }

    def check_state(self, state: Mapping[str, Any], stopped: Mapping[str, int] | None = None) -> None:
        """ValueError unless this data, at the checkpoint's step, is where the checkpoint left it, task by
        task (same example counts, cursors and contents: otherwise the batches would silently differ), with
        the tasks the run had ``stopped`` by then (name -> the first step left out) taking no batch from
        their stop on. A task the checkpoint does not have must join at or after its step; one it has that
        this data lacks has left the run."""
        step = int(state["step"])
        now = (self.with_stops(stopped) if stopped else self).state_dict(step)
        saved_names = list(state.get("tasks", now["tasks"]))
        for t, name in enumerate(now["tasks"]):
            if name not in saved_names:
                if self.turns[t].joined < step:
                    raise ValueError(f"the data changed since the checkpoint: task {name!r} is not in it")
                continue
            k = saved_names.index(name)
            for key in ("examples", "cursors", "fingerprints"):
                if key in state and state[key][k] != now[key][t]:
                    raise ValueError(
                        f"the data changed since the checkpoint: task {name!r}'s {key[:-1]} {state[key][k]} "
                        f"then, {now[key][t]} now"
                    )


def task_tokenizer(spec: WorkloadSpec) -> Any:
    """The tokenizer a workload's data is tokenized with (``lorafleet.data.model_source.data_tokenizer``: the
    same rule as the lengths ``validate`` and ``plan`` measure from data)."""
    return data_tokenizer(spec.model, spec.tokenizer, source="workload")


def workload_tokens(spec: WorkloadSpec, tokenizer: WorkloadTokens | Any | None = None) -> WorkloadTokens:
    """A workload's data as examples through the token cache (``data.workload_tokens``), its tokenizer
    (:func:`task_tokenizer`) loaded at its first need; ``tokenizer``: that tokenizer, loaded already (or the
    ``WorkloadTokens`` itself, returned as it is)."""
    if isinstance(tokenizer, WorkloadTokens):
        return tokenizer
    load = (lambda: tokenizer) if tokenizer is not None else (lambda: task_tokenizer(spec))
    return WorkloadTokens(load, spec.model, spec.tokenizer)


def task_batches(task: TaskSpec, data: TaskData) -> int | None:
    """Global batches a task takes part in: its ``steps``, or its ``epochs`` over its examples; None: unbounded."""
    if task.steps is not None:
        return task.steps
    if task.epochs is not None:
        return max(1, math.ceil(task.epochs * len(data.examples) / task.batch_size))
    return None


def training_streams(
    spec: WorkloadSpec,
    run_steps: int,
    tokenizer: WorkloadTokens | Any | None = None,
    turn_changes: Mapping[str, tuple] | None = None,
    departed: Sequence[TaskTurns] = (),
) -> DataStreams:
    """Every task's data stream as the executor builds it (tokenized with the run's tokenizer, or read from the
    token cache: :func:`workload_tokens`, of ``tokenizer`` when given): its batch size and steps, and its turns
    (its start step, share and deadline, and ``turn_changes``, by task, of the share and deadline while the job
    ran, and the turns of the tasks that ``departed``: ``lorafleet.turns``)."""
    tokens = workload_tokens(spec, tokenizer)
    data = shared_data(spec.tasks, lambda task: prepare_task_data(task, tokens, "workload"))
    return task_streams(spec.tasks, data, spec.seed, turn_changes, departed)


def shared_data(
    tasks: Sequence[TaskSpec], prepare: Callable[[TaskSpec], TaskData], have: Mapping[str, TaskData] | None = None
) -> list[TaskData]:
    """Each task's prepared data, in order: ``have``'s (by name) where it has it, else ``prepare(task)``, once per
    sweep: a sweep's members share one preparation (read, tokenized and split once; ``specs.sweep``)."""
    have = dict(have or {})
    swept = {d.order_name: d for d in have.values() if d.order_name not in (None, d.name)}
    out = []
    for task in tasks:
        data = have.get(task.name)
        if data is None and task.member_of is not None:
            data = swept.get(task.seed_name)
            if data is None:
                data = swept[task.seed_name] = prepare(task)
            data = data if data.name == task.name else replace(data, name=task.name)
        out.append(data if data is not None else prepare(task))
    return out


def task_streams(
    tasks: Sequence[TaskSpec],
    data: Sequence[TaskData],
    seed: int,
    turn_changes: Mapping[str, tuple] | None = None,
    departed: Sequence[TaskTurns] = (),
) -> DataStreams:
    """The streams of ``tasks`` over their prepared ``data`` (in task order): :func:`training_streams` without the
    tokenizing, so a running fleet whose tasks change keeps the data of those that stay (``DataStreams.changed``)."""
    return DataStreams(
        data,
        [t.batch_size for t in tasks],
        seed,
        [task_batches(task, d) for task, d in zip(tasks, data, strict=True)],
        joined=[t.start_step for t in tasks],
        shares=[t.share for t in tasks],
        deadlines=[t.deadline for t in tasks],
        changes=[(turn_changes or {}).get(t.name, ()) for t in tasks],
        departed=departed,
    )
