"""How the profiler measures: busy time (warm-up, repeats, median) and peak bytes.

Time is the process's CPU time (``time.process_time``, all its threads, gloo's included),
not wall time: this machine is shared, and another job taking a core stretches wall time
but not the CPU time our step consumes. With one thread per process a process stands for
one device, so its CPU time is that device's busy time. A TP step counts its slowest rank;
the time a rank sits blocked waiting for its peer is not busy time and is not counted.

Peak bytes on CPU: the torch profiler with ``profile_memory=True`` records every allocation
and free of the CPU allocator as a ``[memory]`` event with a signed byte count; their running
sum, in time order, is the bytes allocated during the measured call, and its maximum is the
peak. Tensors alive before the call (weights, adapters, optimizer states) are not in it;
they are counted separately (``Replica.static_bytes``).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from lorafleet.costmodel.time_model import MS_PER_S



def median_ms(run: Callable[[], object], warmup: int, repeats: int, group: dist.ProcessGroup | None = None) -> float:
    """Median CPU time of ``run()`` in ms after ``warmup`` untimed calls.

    With a process group every repeat starts behind a barrier and takes the slowest rank's
    time, so a TP step is timed as a whole. The garbage collector is off while timing: a
    collection inside one repeat would be charged to that shape.
    """
    for _ in range(warmup):
        run()
    times = []
    gc.disable()
    try:
        for _ in range(repeats):
            if group is not None:
                dist.barrier(group=group)
            start = time.process_time()
            run()
            times.append(time.process_time() - start)
    finally:
        gc.enable()
    if group is not None:
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = slowest.tolist()
    return statistics.median(times) * MS_PER_S


def best_of_rounds(
    runs: Sequence[Callable[[], object]], rounds: int, warmup: int, repeats: int, group: dist.ProcessGroup | None = None
) -> list[float]:
    """``median_ms`` of every run, in ``rounds`` passes over the whole list, keeping each run's smallest.

    Other jobs on a shared machine only ever add time, and they come in bursts that can
    outlast all repeats of one run; a second pass, minutes later, sees a different burst.
    """
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            best[i] = min(best[i], median_ms(run, warmup, repeats, group))
    return best


@contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the duration: the profiler's native layer logs a few lines per
    session (start/stop markers) that would drown the command's own output."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_bytes(run: Callable[[], object], group: dist.ProcessGroup | None = None) -> int:
    """Peak bytes allocated during ``run()`` (the largest across ``group``'s ranks)."""
    gc.collect()
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    # The raw event stream ([memory] events included) is only reachable through kineto_results; it is unordered.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    if group is not None:
        largest = torch.tensor([peak], dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        peak = int(largest.item())
    return peak
