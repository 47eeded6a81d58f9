"""One rank's part of the executor's checkpoints: :class:`Checkpointer` gathers, writes in the background,
and restores (the format and the commit are ``checkpoint.py``'s).

Checkpoints do not stall training (DLRover's flash checkpoint): a save gathers every adapter and
optimizer piece into rank 0's host memory (the only part the ranks wait for), and a background
thread writes and commits it while the next steps run. One write is in flight at a time; the next
save, :meth:`Checkpointer.flush` and :meth:`Checkpointer.close` wait for it, and a failed write raises
there. A process killed mid-write leaves that checkpoint uncommitted, so a resume takes the one before.

Why a component of its own (torchtitan's ``CheckpointManager``): the writer thread and its one write in
flight are state that outlives a step, and only saving, restoring and closing touch them; the executor
decides *when* (its SAVE and RESTORE commands reach every rank in the same order) and this decides *how*.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lorafleet.errors import InputError
from lorafleet.executor.torch.checkpoint import (
    TrainState,
    check_adapter_kinds,
    gather_task_states,
    latest_step_dir,
    load_train_state,
    restore_task_states,
    save_train_state,
)
from lorafleet.executor.torch.optim import TaskOptimizer
from lorafleet.executor.torch.replica import Replica
from lorafleet.runtime.base_quantization import QuantizedBase
from lorafleet.runtime.checkpoint_files import read_manifest, step_dir_name, stopped_tasks
from lorafleet.runtime.data_stream import DataStreams
from lorafleet.specs.lora import LoraSpec


class Checkpointer:
    """Saves and restores this rank's adapter shards and optimizers (module docstring); rank 0 owns the writer."""

    def __init__(
        self,
        replica: Replica,
        optimizers: Sequence[TaskOptimizer],
        streams: DataStreams,
        loras: Sequence[LoraSpec],
        names: Sequence[str],
        base_model: str,
        quantized_base: QuantizedBase | None = None,
    ) -> None:
        """``loras`` and ``names``: each task's adapter and name, in task order; ``base_model`` goes into each
        adapter's config (``ExecutorConfig.base_model``), ``quantized_base`` into each manifest."""
        self.best: dict[str, dict] = {}
        """Rank 0: task name -> the whole matrices of its best-evaluated adapter so far (:meth:`keep_best`), saved in
        every checkpoint beside its adapter and restored from one."""
        self.retask(replica, optimizers, streams, loras, names)
        self.base_model, self.quantized_base = base_model, quantized_base
        self.rank = dist.get_rank()
        self._writer = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafleet-checkpoint") if self.rank == 0 else None
        )
        self._writing: Future[Path] | None = None

    def save(self, directory: str | Path, step: int, extra: dict[str, Any]) -> Path | None:
        """Every rank (collective): the state after ``step`` completed steps gathered into rank 0's memory, whose
        background thread then writes and commits it; rank 0 returns the step directory, the others None."""
        if self.rank == 0:
            self.flush()  # one write in flight, commits in step order
        states = gather_task_states(self.replica, self.optimizers, self.loras, self.names)
        if states is None:
            return None
        state = TrainState(step, states, self.streams.state_dict(step), extra, dict(self.best))
        assert self._writer is not None
        self._writing = self._writer.submit(
            save_train_state, directory, state, base_model=self.base_model, quantized_base=self.quantized_base
        )
        return Path(directory) / step_dir_name(step)

    def retask(
        self,
        replica: Replica,
        optimizers: Sequence[TaskOptimizer],
        streams: DataStreams,
        loras: Sequence[LoraSpec],
        names: Sequence[str],
    ) -> None:
        """What later saves gather: this fleet's tasks (also after a change at a boundary, ``change.py``; a write
        in flight goes on, with its own copy of what it writes)."""
        self.replica, self.optimizers, self.streams = replica, optimizers, streams
        self.loras, self.names = tuple(loras), tuple(names)
        self.best = {name: weights for name, weights in self.best.items() if name in self.names}

    def keep_best(self, tasks: Sequence[int]) -> None:
        """Every rank (collective): the adapters of ``tasks`` (indices) as they are now, kept on rank 0 as their best
        (an evaluation found them so: ``train.evaluation``); one adapter copy a task, no optimizer state."""
        states = gather_task_states(self.replica, self.optimizers, self.loras, self.names, only=set(tasks))
        for state in states or ():
            self.best[state.name] = state.weights

    def flush(self) -> None:
        """Waits for the checkpoint being written, if any; re-raises its error."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def latest(self, directory: str | Path) -> TrainState | None:
        """Rank 0: the latest committed checkpoint of ``directory``, read and checked against the data streams
        (InputError when it was taken on other data); None when there is none. ``step`` is the next step to run."""
        step_dir = latest_step_dir(directory)
        if step_dir is None:
            return None
        step = read_manifest(step_dir)["step"]
        joining = [n for n, j in zip(self.names, self.streams.joined, strict=True) if j >= step]
        state = load_train_state(step_dir, self.names, joining)
        check_adapter_kinds(step_dir, state, self.loras)
        try:
            self.streams.check_state(state.data, stopped_tasks(state.extra))
        except ValueError as err:
            raise InputError(str(step_dir), "data", str(err)) from None
        return state

    def restore(self, state: TrainState) -> None:
        """Every rank (no communication): ``state``'s whole matrices into this rank's shards and optimizers."""
        restore_task_states(self.replica, self.optimizers, state.tasks)
        if self.rank == 0:
            self.best = {name: weights for name, weights in state.best.items() if name in self.names}

    def close(self) -> None:
        """Stops the writer thread once its write is done (after :meth:`flush`)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
