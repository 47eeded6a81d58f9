#!/usr/bin/env bash
# Soak automatic restarts: 50 seeded worker SIGKILLs (both ranks; mid-step, mid-checkpoint-write, just after a
# commit; with and without a CPU hog), each run under --max-restarts checked bitwise against an uninterrupted
# run. Exit 1 unless all 50 recover. About 20 minutes on a 2-core machine. Extra flags go to the script
# (--rounds, --steps, --seed, --keep DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python benchmarks/soak_restarts.py --rounds 50 --steps 30 "$@"
