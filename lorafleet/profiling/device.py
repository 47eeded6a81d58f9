"""The device a profiling rank runs on: its torch device, process group, clock and memory meter.

The profiler has one code path; what depends on the device is here, and nothing else is:

==========  =========================================  =============================================
            cpu                                        cuda
==========  =========================================  =============================================
process     one thread: a process plays one device     one GPU, ``cuda:<rank>``
backend     gloo                                       NCCL
clock       process CPU time (``time.process_time``)   wall time read after ``torch.cuda.synchronize``
peak bytes  running sum of the torch profiler's        ``max_memory_allocated`` after
            CPU allocator ``[memory]`` events          ``reset_peak_memory_stats``, less the bytes
                                                       allocated before the run
==========  =========================================  =============================================

Why CPU time on a CPU: the development machine is shared, and another job taking a core
stretches wall time but not the CPU time our step consumes. Why synchronised wall time on a
GPU: the device's busy time is what the host waits for. A read that first drains the
device's queue brackets every kernel the host launched between two reads, and the host's
own launch overhead too, which is real time on a GPU when small kernels keep it waiting.
(CUDA events would time the device's side alone and need the same synchronisation to be read.)
"""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from lorafleet.specs.gpus import GIB


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class ProfileDevice:
    """One profiling process's device: ``kind``, and for CUDA the GPU ``index`` (the process's rank)."""

    kind: DeviceKind = DeviceKind.CPU
    index: int = 0

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind is DeviceKind.CUDA else torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.kind is DeviceKind.CUDA else "gloo"

    def join(self, rank: int, world: int, store: str) -> None:
        """Takes this process's device and joins the profiler's process group, met in the file ``store`` (a
        file rendezvous: no port to draw, which another process could take before rank 0 listened on it)."""
        init = f"file://{store}"
        if self.kind is DeviceKind.CUDA:
            torch.cuda.set_device(self.index)
            dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=self.torch_device)
        else:
            torch.set_num_threads(1)  # one core per process: a process plays one device
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    def clock(self) -> float:
        """Seconds of this device's busy clock; only differences of two reads mean anything."""
        if self.kind is DeviceKind.CUDA:
            torch.cuda.synchronize(self.index)  # every kernel launched so far has finished
            return time.perf_counter()
        return time.process_time()

    def peak_bytes(self, run: Callable[[], object], group: dist.ProcessGroup | None = None) -> int | None:
        """Peak bytes ``run()`` allocates on this device above what was allocated before it (the
        largest across ``group``'s ranks); None when it ran out of device memory on any rank.

        Tensors alive before the call (weights, adapters, optimizer states) are not in it.
        Running out of memory is only possible on CUDA; a TP peer of a rank that did may then
        wait in a collective of ``run`` forever, so search budgets above the device's memory
        with TP1 only.
        """
        gc.collect()
        peak = _cuda_peak(run, self.index) if self.kind is DeviceKind.CUDA else _cpu_peak(run)
        if group is None:
            return peak
        largest = torch.tensor([OUT_OF_MEMORY if peak is None else peak], dtype=torch.int64, device=self.torch_device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        return None if int(largest.item()) == OUT_OF_MEMORY else int(largest.item())


#: The peak a rank that ran out of memory contributes to the group's maximum.
OUT_OF_MEMORY = torch.iinfo(torch.int64).max


def _cuda_peak(run: Callable[[], object], index: int) -> int | None:
    torch.cuda.synchronize(index)
    before = torch.cuda.memory_allocated(index)
    torch.cuda.reset_peak_memory_stats(index)
    try:
        run()
        torch.cuda.synchronize(index)
    except torch.cuda.OutOfMemoryError:
        oom = True
    else:
        oom = False
    if oom:  # outside the except block: the traceback's frames, and their tensors, are gone
        gc.collect()
        torch.cuda.empty_cache()
        return None
    return torch.cuda.max_memory_allocated(index) - before


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


def _cpu_peak(run: Callable[[], object]) -> int:
    """The torch profiler with ``profile_memory=True`` records every allocation and free of the CPU
    allocator as a ``[memory]`` event with a signed byte count; their running sum, in time order,
    is the bytes allocated during the call, and its maximum is the peak."""
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    # The raw event stream ([memory] events included) is only reachable through kineto_results; it is unordered.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def cuda_device_count() -> int:
    """GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_memory_bytes(index: int = 0) -> int:
    """Total memory of GPU ``index``. Initialises CUDA in this process but allocates nothing on the
    device: the ranks are spawned, so they start clean either way."""
    return torch.cuda.get_device_properties(index).total_memory


def describe_host(kind: DeviceKind) -> str:
    """What the profile ran on, for its ``settings.host``."""
    host = f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}"
    if kind is DeviceKind.CPU:
        return host
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / GIB:.1f} GiB), CUDA {torch.version.cuda}; {host}"
