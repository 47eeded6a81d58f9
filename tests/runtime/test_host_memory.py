"""A CPU rank's freed heap is kept: a step's memory, taken again, costs no page faults (``host_memory``)."""

from __future__ import annotations

import subprocess
import sys

# Runs in a process of its own: the policy is for the whole process and would stay with the test worker.
PROGRAM = """
import resource, torch
from lorafleet.runtime.host_memory import keep_freed_host_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step():  # a 64 MB and an 8 MB tensor, written and freed, as a step's activations
    x, y = torch.ones(16_000_000), torch.ones(2_000_000)
    return float(x[0] + y[0])

def faults_of_steps():
    step(), step()  # the heap grows to a step's size
    before = faults()
    for _ in range(10):
        step()
    return faults() - before

plain = faults_of_steps()
kept = keep_freed_host_memory() and faults_of_steps()
print(plain, kept)
"""


def test_a_step_takes_its_memory_again_without_page_faults():
    """By default glibc unmaps a 64 MB block at free and the next step faults its 15.6 k pages in again;
    once told to keep freed memory, ten more steps fault in at most one step's pages, once (the heap may
    still grow where a small allocation of the interpreter split its free space: seen on a loaded machine
    as one block, the 64 MB or the 8 MB one, faulted in again in some runs)."""
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True).stdout
    plain, kept = (int(v) for v in out.split())
    assert plain >= 10 * 15_625  # ten steps, the 64 MB block (15,625 pages) mapped anew each time
    assert 0 <= kept <= 15_625 + 1_954  # at most a step's two blocks, once: a tenth of the default's
