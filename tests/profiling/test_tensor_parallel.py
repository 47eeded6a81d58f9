"""Megatron-style TP2 over gloo is exact: same block outputs and input gradients as TP1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_tp2_block_matches_tp1():
    script = Path(__file__).with_name("tp_exactness.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
