"""How often lorafleet's processes run Python's cyclic garbage collector: every command (``cli.main``) and every
rank of a training run (``train.rank``, whose rank 0 dispatches each step).

Reference counting frees almost everything these processes make: a plan's millions of short-lived objects
(pydantic schemas, PuLP expressions, micro-batches, step plans), a step's dispatch (about 3,800 micro-batches at
1,024 tenants). The cyclic collector runs a young collection every ``threshold0`` allocations net of frees, and a
full one, which walks every object of the process (40-60 ms in a process holding a 1,024-tenant plan), after ten
middle ones each after ten young ones. At Python's default of 700 a plan of lobra-70b on 64 GPUs ran the collector
~260 times for ~0.1 CPU-s (2 % of the command) and freed almost nothing; at :data:`GC_GEN0_THRESHOLD`, 12 times for
0.035 s. A 1,024-tenant dispatch at 700 landed a full collection in about 9 steps of 100, which made its p95
(``benchmarks/bench_dispatch.py`` counts them).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

GC_GEN0_THRESHOLD = 10_000
"""Allocations, net of frees, between two young-generation collections (Python's default: 700)."""


@contextmanager
def fewer_collections() -> Iterator[None]:
    """The young generation collected every :data:`GC_GEN0_THRESHOLD` allocations meanwhile (the older
    generations' thresholds as they were); the thresholds as they were afterwards."""
    thresholds = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
