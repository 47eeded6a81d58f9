"""A CPU rank's freed heap is kept: a step's memory, taken again, costs no page faults (``host_memory``)."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in a process of its own: the policy is for the whole process and would stay with the test worker.
PROGRAM = """
import json, resource, torch
from lorafleet.runtime.host_memory import keep_freed_host_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step():  # a 64 MB and an 8 MB tensor, written and freed, as a step's activations
    x, y = torch.ones(16_000_000), torch.ones(2_000_000)
    return float(x[0] + y[0])

def faults_of_steps():  # the page faults of each of ten steps, after two that grow the heap to a step's size
    step(), step()
    counts = []
    for _ in range(10):
        before = faults()
        step()
        counts.append(faults() - before)
    return counts

plain = faults_of_steps()
kept = keep_freed_host_memory() and faults_of_steps()
print(json.dumps([plain, kept]))
"""


def test_a_step_takes_its_memory_again_without_page_faults():
    """By default glibc unmaps a 64 MB block at free and every next step faults its 15.6 k pages in again;
    once told to keep freed memory, a step takes its blocks again without faulting them in. The heap may
    still grow where a small allocation of the interpreter split its free space (seen on a loaded machine:
    one step in ten, sometimes two, faulted a block in again), so most steps, not every one, are free."""
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True).stdout
    plain, kept = json.loads(out)
    assert all(count >= 15_625 for count in plain)  # the 64 MB block (15,625 pages) mapped anew each step
    assert sum(count < 1_954 for count in kept) >= 7, kept  # under the 8 MB block's pages: nothing mapped anew
