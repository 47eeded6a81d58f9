"""Triton kernels against the torch path, in Triton's interpreter: the driver.

``TRITON_INTERPRET=1`` must be set before *triton* is first imported (``triton.language``'s own
helpers are decorated at import, and ``peft`` imports triton through torch), which a normal test
session has already done. So the cases live in ``interpreted_segment_lora.py`` (not collected
by name) and run here in a fresh interpreter with the variable set (``--noconftest`` keeps
transformers and peft out of it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.repo import REPO

CASES_FILE = Path(__file__).with_name("interpreted_segment_lora.py")


def test_kernels_in_interpreter():
    """Runs every case of ``interpreted_segment_lora.py`` in a fresh interpreter with TRITON_INTERPRET=1."""
    repo = REPO
    command = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", str(CASES_FILE)]
    result = subprocess.run(
        command, cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
