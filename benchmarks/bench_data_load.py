"""CPU-seconds of a rank's data load and of a whole ``lorafleet train --steps 2`` on the demo's defaults (``make
demo-train``: SmolLM2-135M's GGUF, its four tasks, one CPU rank), the token cache cold (the data tokenized) and
warm (its examples read: ``data.length_cache``), interleaved.

    python benchmarks/bench_data_load.py [--rounds 2] [--skip-launch]

Each round runs, cold then warm, each in a fresh process with a cache directory of its own:

- **rank data load**: what a rank does for its data (``train.trainer.train_rank``), torch imported before:
  ``workload_tokens`` then ``training_streams`` (the tokenizer loaded and the data tokenized, or the examples
  read back; the overflow rule; the streams), its CPU (``process_time``), whether it loaded the tokenizer, and
  then the tokenizer's load where it was not loaded (rank 0 loads it to save it beside the adapters; the other
  ranks need not): the streams' fingerprints (every token and label) must be the same on both sides, or the
  script stops;
- **launch**: the whole command on a plan made once (``lorafleet plan --gpus 1 --gpu cpu``), the CPU of its
  process tree (``os.wait4``: the launcher, torchrun, the rank).

A warm side's cache is warmed once, untimed, by a rank data load. Printed: each run, the medians, warm / cold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_launch_cpu import launch_cpu  # noqa: E402

from lorafleet.data.length_cache import CACHE_ENV  # noqa: E402

WORKLOAD = REPO / "examples" / "demo" / "workload.yaml"
RANK_LOAD = """
import json, sys, time
import torch  # a rank has imported it (its process group) before it loads data
from lorafleet.runtime.data_stream import training_streams, workload_tokens
from lorafleet.workload import load_workload
spec = load_workload(sys.argv[1]).spec
start = time.process_time()
tokens = workload_tokens(spec)
streams = training_streams(spec, 2, tokens)
loaded = "transformers" in sys.modules
middle = time.process_time()
tokens.tokenizer()  # rank 0 loads it for the run's exports: already loaded when the data was tokenized
print(json.dumps({"streams_s": middle - start, "tokenizer_s": time.process_time() - middle, "loaded": loaded,
                  "fingerprints": [s.data.fingerprint for s in streams.streams]}))
"""


def rank_load(cache: Path) -> dict:
    """A rank's data load in a fresh process (module doc)."""
    done = subprocess.run(
        [sys.executable, "-c", RANK_LOAD, str(WORKLOAD)],
        env={**os.environ, CACHE_ENV: str(cache)},
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return json.loads(done.stdout.splitlines()[-1])


def entry_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "tokens").iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-launch", action="store_true", help="time the rank's data load only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-data-load-"))
    try:
        plan = root / "plan.json"
        if not args.skip_launch:
            subprocess.run(
                [sys.executable, "-m", "lorafleet", "plan", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu"]
                + ["--json", str(plan)],
                check=True,
                capture_output=True,
                cwd=REPO,
            )
        warm = root / "warm-cache"
        reference = rank_load(warm)["fingerprints"]
        print(f"warm cache: {entry_bytes(warm):,} bytes for the demo's four tasks", flush=True)
        results: dict[str, dict[str, list[float]]] = {
            side: {"rank": [], "rank 0": [], "launch": []} for side in ("cold", "warm")
        }
        for i in range(args.rounds):
            for side in ("cold", "warm"):
                cache = warm if side == "warm" else root / f"cold-{i}"
                load = rank_load(cache)
                if load["fingerprints"] != reference:
                    raise SystemExit(f"round {i + 1} {side}: the examples differ from the first tokenization's")
                results[side]["rank"].append(load["streams_s"])
                results[side]["rank 0"].append(load["streams_s"] + load["tokenizer_s"])
                line = (
                    f"round {i + 1} {side}: rank data load {load['streams_s']:.2f} CPU-s (tokenizer loaded: "
                    f"{load['loaded']}), then rank 0's tokenizer {load['tokenizer_s']:.2f}"
                )
                if not args.skip_launch:
                    launch_cache = warm if side == "warm" else root / f"cold-{i}-launch"
                    argv = ["train", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu", "--plan", str(plan), "--steps", "2"]
                    argv += ["--out", str(root / f"run-{side}-{i}")]
                    tree = launch_cpu(argv, {**os.environ, CACHE_ENV: str(launch_cache)})
                    results[side]["launch"].append(tree)
                    line += f", whole launch {tree:.2f} CPU-s"
                print(line, flush=True)
        for what in ("rank", "rank 0", "launch"):
            if results["cold"][what]:
                cold, warm_s = statistics.median(results["cold"][what]), statistics.median(results["warm"][what])
                print(f"{what}: median cold {cold:.2f}, warm {warm_s:.2f} CPU-s; warm/cold {warm_s / cold:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
