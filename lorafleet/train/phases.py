"""Start-up phases of ``lorafleet train`` on the console, as they happen: each a flushed line with the
seconds since the command started (the launcher's clock, handed to its workers in ``LORAFLEET_T0``)::

    lorafleet train: [  0.4s] checked: 4 tasks, <1,1> x 2 on 2 GPUs
    lorafleet train: [  0.4s] starting 2 worker processes (torchrun)
    lorafleet train: [  6.1s] process group up: 2 ranks (gloo)
    lorafleet train: [  6.9s] tokenized: 4 tasks, 1,200 examples, 211,430 tokens
    lorafleet train: [  8.2s] base model loaded: HuggingFaceTB/SmolLM2-135M-Instruct, 134.5M parameters, float32
    lorafleet train: [  8.3s] training steps 0..9 of 10

Under nohup, Slurm or a pod these lines (and the per-step lines after them) are what a user sees while
a run starts: where it is, and how long each part took.
"""

from __future__ import annotations

import os
import sys
import time

T0_ENV = "LORAFLEET_T0"
"""The ``time.time()`` at which ``lorafleet train`` started (set by the launcher, read by its workers)."""


def start_clock() -> None:
    """Mark now as the run's start, unless a launcher already did (its workers inherit the mark). Where
    stderr is not a terminal (a log file), the libraries' progress bars (tqdm's: transformers' weight
    loading, GGUF de-quantizing), which would write a carriage-returned line per update, are turned off
    for this process and the workers it starts (``TQDM_DISABLE``, read when tqdm is imported)."""
    os.environ.setdefault(T0_ENV, repr(time.time()))
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 GPU``, ``2 GPUs`` (``plural`` where it is not ``noun`` + s)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"


def idle_gpus(used: int, held: int) -> str:
    """What the ``checked:`` line adds when the plan uses fewer GPUs than the run has (a plan made for fewer than
    ``--gpus``): ``; 1 of the 2 GPUs stays idle (...)``; empty when it uses them all."""
    idle = held - used
    if idle <= 0:
        return ""
    verb = "stays" if idle == 1 else "stay"
    return (
        f"; {idle:,} of the {held:,} GPUs {verb} idle: the plan uses {used:,} (plan again with --gpus {held} to use "
        "them)"
    )


def phase(message: str) -> None:
    """Print one start-up phase, with the seconds since :func:`start_clock` (since now, without one)."""
    try:
        t0 = float(os.environ.get(T0_ENV, ""))
    except ValueError:
        t0 = time.time()
    print(f"lorafleet train: [{max(time.time() - t0, 0.0):6.1f}s] {message}", flush=True)
