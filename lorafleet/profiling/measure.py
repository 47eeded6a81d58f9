"""How the profiler measures: busy time (warm-up, repeats, median) and peak bytes.

Time is the device's busy clock (``ProfileDevice.clock``): on a CPU the process's CPU time
(``time.process_time``, all its threads, gloo's included), not wall time: this machine is
shared, and another job taking a core stretches wall time but not the CPU time our step
consumes. With one thread per process a process stands for one device, so its CPU time is
that device's busy time. On a GPU it is wall time read after the device has drained its
queue. A TP step counts its slowest rank; on a CPU the time a rank sits blocked waiting for
its peer is not busy time and is not counted.

Peak bytes (``ProfileDevice.peak_bytes``) are those allocated during the measured call: the
CPU allocator's events on a CPU, the CUDA allocator's peak on a GPU. Tensors alive before
the call (weights, adapters, optimizer states) are not in it; they are counted separately
(``ProfiledReplica.static_bytes``).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lorafleet.costmodel.time_model import MS_PER_S
from lorafleet.profiling.device import ProfileDevice

CPU = ProfileDevice()


def median_ms(
    run: Callable[[], object],
    warmup: int,
    repeats: int,
    group: dist.ProcessGroup | None = None,
    device: ProfileDevice = CPU,
) -> float:
    """Median busy time of ``run()`` in ms after ``warmup`` untimed calls.

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
            start = device.clock()
            run()
            times.append(device.clock() - start)
    finally:
        gc.enable()
    if group is not None:
        slowest = torch.tensor(times, dtype=torch.float64, device=device.torch_device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = slowest.tolist()
    return statistics.median(times) * MS_PER_S


def best_of_rounds(
    runs: Sequence[Callable[[], object]],
    rounds: int,
    warmup: int,
    repeats: int,
    group: dist.ProcessGroup | None = None,
    device: ProfileDevice = CPU,
) -> list[float]:
    """``median_ms`` of every run, in ``rounds`` passes over the whole list, keeping each run's smallest.

    Other jobs on a shared machine only ever add time, and they come in bursts that can
    outlast all repeats of one run; a second pass, minutes later, sees a different burst.
    """
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            best[i] = min(best[i], median_ms(run, warmup, repeats, group, device))
    return best
