"""The profiler's device abstraction, CPU side (the CUDA side needs a GPU: tests/gpu and
scripts/gpu_check.sh), and the GPU preset a CUDA device name maps to."""

from __future__ import annotations

import time

import pytest
import torch

from lorafleet.executor.torch.precision import Precision, torch_dtype
from lorafleet.profiling.device import DeviceKind, ProfileDevice
from lorafleet.profiling.measure import CPU, median_ms
from lorafleet.specs.gpus import GIB, gpu_preset_for

MIB = 1 << 20


def test_cpu_device_is_a_gloo_process_on_the_host():
    cpu = ProfileDevice()
    assert cpu.kind is DeviceKind.CPU and cpu.backend == "gloo" and cpu.torch_device == torch.device("cpu")
    cuda = ProfileDevice(DeviceKind.CUDA, 3)
    assert cuda.backend == "nccl" and cuda.torch_device == torch.device("cuda", 3)  # no GPU needed to name it


def test_cpu_clock_counts_work_not_waiting():
    clock = ProfileDevice().clock
    start = clock()
    time.sleep(0.3)
    slept = clock() - start
    # Spin until the clock has counted 0.2 s of work (a wall-clock spin gets a third of a core while the
    # other test worker runs a process group); a clock that counted nothing would never get there.
    start = clock()
    cap = time.perf_counter() + 30.0
    while clock() - start < 0.2 and time.perf_counter() < cap:
        pass
    busy = clock() - start
    assert slept < 0.1 and busy >= 0.2, (slept, busy)


def test_cpu_peak_is_what_the_run_allocates_above_what_existed():
    held = torch.zeros(4 * MIB // 4)  # alive before the run: not counted

    def run():
        a = torch.ones(MIB // 4)  # 1 MiB
        b = torch.ones(2 * MIB // 4)  # 2 MiB more while a lives
        return (a.sum() + b.sum() + held[0]).item()

    peak = CPU.peak_bytes(run)
    assert 3 * MIB <= peak < 4 * MIB
    assert CPU.peak_bytes(lambda: None) == 0


def test_median_is_in_ms_of_the_device_clock():
    assert median_ms(lambda: sum(range(20_000)), warmup=1, repeats=3, device=ProfileDevice()) > 0


def test_precisions():
    assert (torch_dtype(Precision.FP32), Precision.FP32.bytes) == (torch.float32, 4)
    assert (torch_dtype(Precision.BF16), Precision.BF16.bytes) == (torch.bfloat16, 2)
    for precision in Precision:  # the torch-free vocabulary's sizes are torch's
        assert torch.finfo(torch_dtype(precision)).bits // 8 == precision.bytes


@pytest.mark.parametrize(
    "name,memory_gib,preset",
    [
        ("NVIDIA H200", 143771 / 1024, "H200-141GB"),  # as nvidia-smi reports the H200 of the device machine
        ("NVIDIA H100 80GB HBM3", 79.6, "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", 79.2, "A100-80GB"),
        ("NVIDIA RTX A6000", 47.5, "A6000-48GB"),
        ("NVIDIA L40S", 44.4, "L40S"),
        ("NVIDIA GeForce RTX 4090", 23.6, None),
    ],
)
def test_gpu_preset_follows_the_device_name_and_memory(name, memory_gib, preset):
    assert gpu_preset_for(name, int(memory_gib * GIB)) == preset
