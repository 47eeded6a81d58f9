"""A CPU rank's heap: freed memory is kept for the next step instead of going back to the kernel.

Torch's CPU allocator is glibc's ``malloc``. By default glibc serves a large block (above a threshold
that adapts, from 128 KiB up to 32 MiB) with a fresh ``mmap`` and returns it at ``free``, and trims
the top of its heap when more than twice that is free there. So the memory a step's activations
and gradients take is given back at the step's end, and the next step takes it again, page by
page: each 4 KiB page is a minor fault that the kernel zero-fills, ~0.9 us on the 2-core development
machine (measured: a fresh GiB costs 0.36 s of CPU to fill, a second fill 0.13 s).

The first step paid this in bulk. On the demo (SmolLM2-135M, ~2,400 tokens a step, one thread) it
took 0.6-1.3 M faults, 0.5-1.2 s of CPU, although the probe had just run the same step's work:
between the probe and the step the freed heap had been trimmed (later steps kept theirs only
because the optimizer's first step allocates its moments on top of the heap, where they pin it).

:func:`keep_freed_host_memory` asks glibc to serve every block from the heap (``M_MMAP_MAX = 0``) and
never to trim it (``M_TRIM_THRESHOLD = -1``): the probe's warm-up grows the heap to a step's size once
and every step after reuses it (measured: 12 k faults in the first step, 0-4 in the next ones). The
cost is that a rank's resident memory stays at its peak, which a training rank reaches every step
anyway. Only CPU ranks ask for it: on a GPU the step's tensors are not on the host, and a host peak
there (loading a checkpoint) would stay resident for nothing.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""``mallopt`` parameters (glibc's ``malloc.h``)."""


def keep_freed_host_memory() -> bool:
    """Makes glibc keep this process's freed memory (module doc); False where the C library is not glibc
    (nothing is changed there)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt, their own allocator policy
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))
