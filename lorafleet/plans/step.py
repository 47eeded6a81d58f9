"""What each step passes on: dispatch turns a :class:`GlobalBatch` into a :class:`StepPlan` (every sequence
assigned to one replica and one micro-batch, rows contiguous by task), and an executor runs the StepPlan and
returns a :class:`StepReport`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from lorafleet.costmodel.time_model import MicroBatchShape


@dataclass(frozen=True)
class GlobalBatch:
    """One step's sequences, all tasks together; sequence i is (task_ids[i], sample_ids[i], lengths[i])."""

    step: int
    task_ids: np.ndarray
    """Index into the workload's tasks, per sequence (int64)."""
    sample_ids: np.ndarray
    """Which sample of its task's data stream (int64): what the torch executor loads."""
    lengths: np.ndarray
    """Token length after the task's overflow policy (int64)."""
    truncated: int = 0
    """Sequences cut to their context length to build this batch."""
    rejected: int = 0
    """Sequences dropped (and replaced by the next sample) for exceeding their context length."""

    def __len__(self) -> int:
        return int(self.lengths.size)


@dataclass(init=False, repr=False, eq=False)
class MicroBatch:
    """Sequences one replica processes together, ordered so each task's rows are contiguous.

    ``MicroBatch(seq_ids, task_ids, lengths, padded_len)``: a dataclass of those four fields (``dataclasses.replace``
    and ``fields`` work), read-only, compared, hashed, printed and pickled by their values. It reads as its own
    :class:`MicroBatchShape` (``seq_lens``, ``padded_len``, ``n_seqs``, ``tokens``), so a replica's micro-batches
    are priced as they are (``dispatch.placed_work``), without a shape object each; :attr:`shape` makes one.

    ``MicroBatch(seqs, tasks, lens, padded_len, start, stop)`` is rows ``start:stop`` of the three tuples, which the
    micro-batches of one replica share (the packer's, ``dispatch.microbatch``): one object a micro-batch rather than
    four (the object and three tuples; the fields are sliced when read). A service-scale step builds thousands of
    them, and every object a step keeps counts towards the interpreter's next garbage collection, whose full pass
    over the process heap (tens of ms) set the dispatcher's 95th percentile (docs/dispatch.md)."""

    __slots__ = ("_lengths", "_padded_len", "_seq_ids", "_start", "_stop", "_task_ids")

    # the fields, read-only: the properties below (a dataclass field's default is its class attribute, here the
    # property, which the generated methods left out here do not read; ``replace`` and ``fields`` see the four)
    seq_ids: tuple[int, ...]
    task_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    padded_len: int | None

    def __init__(
        self,
        seq_ids: tuple[int, ...],
        task_ids: tuple[int, ...],
        lengths: tuple[int, ...],
        padded_len: int | None,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self._seq_ids = seq_ids  # one store each: a packed plan makes hundreds of thousands (no tuple to unpack)
        self._task_ids = task_ids
        self._lengths = lengths
        self._padded_len = padded_len
        self._start = start
        self._stop = len(lengths) if stop is None else stop

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """Positions in the step's GlobalBatch."""
        return self._seq_ids[self._start : self._stop]

    @property
    def task_ids(self) -> tuple[int, ...]:
        return self._task_ids[self._start : self._stop]

    @property
    def lengths(self) -> tuple[int, ...]:
        return self._lengths[self._start : self._stop]

    # a C getter rather than a method: read for every micro-batch ordered and priced
    padded_len = property(attrgetter("_padded_len"), doc="Every row padded to this length; ``None`` when packed.")

    def _values(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int | None]:
        return self.seq_ids, self.task_ids, self.lengths, self._padded_len

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not MicroBatch:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return (
            f"MicroBatch(seq_ids={self.seq_ids!r}, task_ids={self.task_ids!r}, lengths={self.lengths!r}, "
            f"padded_len={self._padded_len!r})"
        )

    def __reduce__(self) -> tuple[type[MicroBatch], tuple]:
        return MicroBatch, self._values()  # its own rows only, not the replica's it is a view of

    @property
    def tokens(self) -> int:
        """Tokens the micro-batch occupies, padding included (what must fit in M)."""
        if self._padded_len is not None:
            return self._padded_len * (self._stop - self._start)
        return sum(self._lengths[self._start : self._stop])

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """The lengths, as :class:`MicroBatchShape` names them."""
        return self._lengths[self._start : self._stop]

    @property
    def n_seqs(self) -> int:
        return self._stop - self._start

    @property
    def padding_tokens(self) -> int:
        return self.tokens - sum(self.lengths)

    @property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """``(task_id, first_row, n_rows)`` per contiguous run of one task's sequences."""
        runs: list[tuple[int, int, int]] = []
        for row, task in enumerate(self.task_ids):
            if runs and runs[-1][0] == task:
                runs[-1] = (task, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((task, row, 1))
        return tuple(runs)

    @property
    def shape(self) -> MicroBatchShape:
        return MicroBatchShape(self.lengths, self._padded_len)  # positional: built for every micro-batch priced


@dataclass(frozen=True)
class ReplicaWork:
    """One replica's share of a step."""

    replica_id: int
    microbatches: tuple[MicroBatch, ...]
    estimated_time_s: float


@dataclass(frozen=True)
class StepPlan:
    """Every sequence of one global batch placed on a replica and in a micro-batch."""

    step: int
    bucket_boundaries: tuple[int, ...]
    work: tuple[ReplicaWork, ...]
    """One entry per replica of the deployment, in replica order (possibly with no micro-batches)."""
    estimated_makespan_s: float
    method: str = ""
    """Dispatch method and status (``lpt``, ``milp:optimal``, ``milp-timeout->lpt``)."""
    solve_s: float = 0.0
    """Wall time spent computing this plan (bucketing, assignment, micro-batches)."""
    truncated: int = 0
    rejected: int = 0
    speed: tuple[float, ...] = ()
    """Per replica, the factor the dispatcher multiplied the cost model's times by (online
    recalibration, :mod:`lorafleet.dispatch.recalibration`); empty: 1 for every replica."""

    def base_estimate(self, position: int) -> float:
        """The uncorrected cost model's estimate of replica ``position``'s time (its estimate over its speed factor)."""
        estimate = self.work[position].estimated_time_s
        return estimate / self.speed[position] if self.speed else estimate

    @property
    def n_seqs(self) -> int:
        return sum(len(mb.lengths) for w in self.work for mb in w.microbatches)

    @property
    def tokens(self) -> int:
        return sum(sum(mb.lengths) for w in self.work for mb in w.microbatches)

    @property
    def padding_tokens(self) -> int:
        return sum(mb.padding_tokens for w in self.work for mb in w.microbatches)

    @property
    def padding_ratio(self) -> float:
        """Padding tokens over all occupied tokens (LobRA's padding ratio)."""
        total = self.tokens + self.padding_tokens
        return self.padding_tokens / total if total else 0.0

    def task_token_counts(self, names: Sequence[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Each task's real tokens and padding tokens in this step, keyed ``names[task_id]`` (every name, 0 for a
        task without a sequence here): a padded row pads up to its micro-batch's length, a packed micro-batch
        has no padding. What an executor reports (``StepReport.task_tokens``, ``task_padding_tokens``)."""
        tokens = dict.fromkeys(names, 0)
        padding = dict.fromkeys(names, 0)
        for work in self.work:
            for mb in work.microbatches:
                for task, length in zip(mb.task_ids, mb.lengths, strict=True):
                    tokens[names[task]] += length
                    padding[names[task]] += mb.padded_len - length if mb.padded_len is not None else 0
        return tokens, padding


@dataclass(frozen=True)
class StepReport:
    """What an executor measured (or simulated) for one step."""

    step: int
    replica_busy_s: tuple[float, ...]
    """Busy time per replica, in deployment order."""
    makespan_s: float
    """Wall time of the step: the slowest replica plus synchronisation."""
    task_tokens: dict[str, int] = field(default_factory=dict)
    """Real (non-padding) tokens per task."""
    task_padding_tokens: dict[str, int] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    """Mean token loss per task (real executors only)."""
    estimated_makespan_s: float = 0.0
    dispatch_solve_s: float = 0.0
    failed_replicas: tuple[int, ...] = ()
    rank_cpu_s: tuple[float, ...] = ()
    """Process CPU seconds of each rank during the step (torch executor; the CPU analogue of GPU-seconds)."""
    nonfinite_tasks: tuple[str, ...] = ()
    """Tasks whose update this step was skipped: a non-finite loss or gradient norm."""
    unmoved_tasks: tuple[str, ...] = ()
    """Tasks found, at this step, not to have moved their adapter at all since their warm-up began."""
    task_lr: dict[str, float] = field(default_factory=dict)
    """Each updated task's learning rate this step (its schedule's ``η_s``; torch executor only)."""
    task_grad_norm: dict[str, float] = field(default_factory=dict)
    """Each updated task's gradient norm this step, summed over the fleet, before clipping (torch executor only)."""
    task_epoch: dict[str, float] = field(default_factory=dict)
    """Each task's epochs done after this step: the rows its batches drew so far over its rows (torch executor)."""

    @property
    def replica_idle_s(self) -> tuple[float, ...]:
        return tuple(self.makespan_s - b for b in self.replica_busy_s)

    @property
    def utilisation(self) -> float:
        """Mean busy fraction over replicas."""
        if not self.replica_busy_s or self.makespan_s <= 0:
            return 0.0
        return float(np.mean(self.replica_busy_s) / self.makespan_s)
