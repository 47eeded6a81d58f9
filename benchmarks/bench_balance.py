"""Balance time: every balance of one ``lorafleet plan`` replayed on this tree and on another, taking turns.

Run from the repository root::

    .venv/bin/python benchmarks/bench_balance.py --against ../before examples/lobra-7b.yaml
    .venv/bin/python benchmarks/bench_balance.py --against ../before --rounds 5 examples/lobra-70b.yaml --gpus 64

The plan runs once, in this process, on this tree, recording the inputs (load model, allowed pairs) and the
answer of every balance it makes (``lorafleet.dispatch.balance._balance``: the fast method's and the length
baseline's). Each round then replays them all in a fresh process on this tree and one on TREE (``PYTHONPATH``),
the sides taking turns; a process times its replay twice and keeps the less (CPU seconds), and checks that every
balance returns the recorded counts and makespan, bit for bit (a change to the balancers that is meant to be
exact must pass). Printed: both sides' least CPU seconds over the rounds and their ratio (this / TREE).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def capture(plan_args: list[str], path: Path) -> int:
    """Run ``lorafleet plan plan_args`` here, writing every balance's (load, allowed, answer) to ``path``."""
    from lorafleet import cli
    from lorafleet.dispatch import balance

    records = []
    balance_alone = balance._balance

    def recorded(load, allowed):
        answer = balance_alone(load, allowed)
        records.append((load, allowed, answer))
        return answer

    balance._balance = recorded
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(["plan", *plan_args])
    finally:
        balance._balance = balance_alone
    path.write_bytes(pickle.dumps(records))
    return len(records)


def replay(path: Path) -> float:
    """The least CPU seconds of two replays of the recorded balances; raises if one answers differently."""
    from lorafleet.dispatch import balance

    records = pickle.loads(path.read_bytes())
    least = float("inf")
    for _ in range(2):
        start = time.process_time()
        answers = [balance._balance(load, allowed) for load, allowed, _ in records]
        least = min(least, time.process_time() - start)
        for (_, _, recorded), answer in zip(records, answers, strict=True):
            if not (np.array_equal(answer.counts, recorded.counts) and answer.makespan_s == recorded.makespan_s):
                raise SystemExit("a balance answers differently from the recorded one")
    return least


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)  # the rest is the plan's
    parser.add_argument("--against", metavar="TREE", required=True, help="the other checkout (its repository root)")
    parser.add_argument("--rounds", type=int, default=3, help="replays a side, taking turns (the least counts)")
    parser.add_argument("--replay", metavar="FILE", help=argparse.SUPPRESS)  # the rounds' subprocesses
    args, plan_args = parser.parse_known_args()
    if args.replay:
        print(json.dumps({"cpu_s": replay(Path(args.replay))}))
        return
    if not plan_args:
        parser.error("the plan's arguments (a workload file and its options) are missing")
    sides = {"this": ROOT, "against": Path(args.against).resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "balances.pkl"
        print(f"{capture(plan_args, path)} balances of lorafleet plan {' '.join(plan_args)}", flush=True)
        least = dict.fromkeys(sides, float("inf"))
        for _ in range(args.rounds):
            for side, tree in sides.items():
                env = {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": "1"}
                out = subprocess.run(
                    [sys.executable, __file__, "--against", str(tree), "--replay", str(path)],
                    env=env,
                    cwd=tree,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                least[side] = min(least[side], json.loads(out)["cpu_s"])
    print(f"this tree {least['this']:.3f} CPU s, {sides['against']} {least['against']:.3f} CPU s, ", end="")
    print(f"ratio {least['this'] / least['against']:.3f} (least of {args.rounds} rounds, two replays a round)")


if __name__ == "__main__":
    main()
