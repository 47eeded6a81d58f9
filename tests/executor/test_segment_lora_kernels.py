"""Triton kernels against the torch path, in Triton's interpreter (fp32, tiny shapes, CPU).

``TRITON_INTERPRET=1`` must be set before *triton* is first imported, not just before the
kernels are: ``triton.language``'s own helpers (``tl.zeros``, ...) are ``@jit`` functions
decorated at import, and ``peft`` imports triton (through torch), so in a normal test session
it is too late. Unless the whole session runs interpreted, :func:`test_kernels_in_interpreter`
re-runs this file in a subprocess with the variable set from the start (``--noconftest`` keeps
transformers and peft out of it).

bf16 is not tested here: the interpreter's ``tl.dot`` multiplies bf16 bit patterns (Triton
issues #4972, #11584). Each case caps the tiles at 16 or 64, so the cases cover one-tile and
multi-tile code (loops over K, N, rank and a segment's rows).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES_FILE = Path(__file__).with_name("interpreted_segment_lora.py")


def test_kernels_in_interpreter():
    """Runs every case of ``interpreted_segment_lora.py`` in a fresh interpreter with TRITON_INTERPRET=1."""
    repo = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", str(CASES_FILE)]
    result = subprocess.run(
        command, cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
