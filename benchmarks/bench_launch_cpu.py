"""CPU-seconds of a ``lorafleet train`` launch with the token-length cache cold (every launch before it
existed: the launcher loads the tokenizer, so transformers and torch, and tokenizes each task) and warm (the
launcher reads each task's lengths from ``data.length_cache``: no tokenizer, no torch), interleaved.

    python benchmarks/bench_launch_cpu.py [--rounds 3] [--steps 2]

Each round runs, cold then warm:

- **launcher**: the launcher's own path up to spawning its workers (check, plan, run length, claim, run file:
  ``train.preflight.prepare`` .. ``ResolvedRun.save``) in a fresh process, its own CPU (``RUSAGE_SELF``), and
  whether it imported torch;
- **launch**: the whole command, ``lorafleet train --steps N`` on two CPU workers (gloo), the CPU of its process
  tree (``os.wait4``: the launcher, torchrun and the workers).

The workload is the smallest the training tests and soaks launch (``soak_restarts.write_workload``): the demo's
docsum and chat on ``tiny-llama`` with the project's tiny tokenizer, on a plan of two one-GPU replicas. Printed:
each run, the medians, and warm / cold.
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
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from soak_restarts import write_workload as soak_workload  # noqa: E402

from lorafleet.data.length_cache import CACHE_ENV  # noqa: E402
from tests.helpers import fleet_harness as h  # noqa: E402

LAUNCHER_PATH = """
import json, resource, sys
from dataclasses import replace
from lorafleet.cli import build_parser
from lorafleet.commands.train import options_of
from lorafleet.train.preflight import claim, prepare, queue_data_roots
from lorafleet.train.run_file import ResolvedRun
from lorafleet.train.run_length import with_run_steps
options = options_of(build_parser().parse_args(sys.argv[1:]))
prepared = prepare(options)
options = with_run_steps(replace(options, queue_data_roots=queue_data_roots(options, prepared.workload)), prepared)
lock = claim(options, prepared)
ResolvedRun.of(replace(options, plan=str(options.run_dir.plan)), prepared).save(options.run_dir)
lock.release()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime, "torch": "torch" in sys.modules}))
"""


def write_workload(root: Path) -> tuple[Path, Path]:
    """The soaks' workload (``soak_restarts.write_workload``) under ``root``, and its plan: two one-GPU replicas."""
    workload = soak_workload(root)
    plan = replace(h.plan_of((1, 1), (1, 1, True)), tasks=("docsum", "chat"), bucket_boundaries=(256,))
    plan.save(root / "plan.json")
    return workload, root / "plan.json"


def launcher_cpu(argv: list[str], env: dict[str, str]) -> dict:
    """The launcher's path to spawning, in a fresh process: its CPU-s and whether it imported torch."""
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER_PATH, *argv], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def launch_cpu(argv: list[str], env: dict[str, str]) -> float:
    """The whole ``lorafleet train`` command: CPU-s of its process tree (every process it waited for)."""
    with tempfile.TemporaryFile() as err:
        process = subprocess.Popen([sys.executable, "-m", "lorafleet", *argv], env=env, stdout=err, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            err.seek(0)
            raise SystemExit(f"lorafleet train failed: {err.read().decode()[-2000:]}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    try:
        workload, plan = write_workload(root)
        warm_cache = root / "warm-cache"
        results: dict[str, dict[str, list]] = {side: {"launcher": [], "launch": []} for side in ("cold", "warm")}
        for i in range(args.rounds):
            for side in ("cold", "warm"):
                if side == "warm" and not warm_cache.exists():  # warmed by a launcher path, not timed
                    launcher_cpu(_argv(workload, plan, root / "warming", args.steps), _env(warm_cache))
                caches = (warm_cache, warm_cache) if side == "warm" else (root / f"cold-{i}-a", root / f"cold-{i}-b")
                own = launcher_cpu(_argv(workload, plan, root / f"{side}-{i}-path", args.steps), _env(caches[0]))
                tree = launch_cpu(_argv(workload, plan, root / f"{side}-{i}-run", args.steps), _env(caches[1]))
                results[side]["launcher"].append(own["cpu_s"])
                results[side]["launch"].append(tree)
                print(
                    f"round {i + 1} {side}: launcher path {own['cpu_s']:.2f} CPU-s (torch imported: {own['torch']}), "
                    f"whole launch {tree:.2f} CPU-s",
                    flush=True,
                )
        for what in ("launcher", "launch"):
            cold = statistics.median(results["cold"][what])
            warm = statistics.median(results["warm"][what])
            ratio = warm / cold
            print(f"{what}: median cold {cold:.2f}, warm {warm:.2f} CPU-s; warm/cold {ratio:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _argv(workload: Path, plan: Path, out: Path, steps: int) -> list[str]:
    return ["train", str(workload), "--plan", str(plan), "--out", str(out), "--device", "cpu", "--steps", str(steps)]


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, CACHE_ENV: str(cache)}


if __name__ == "__main__":
    main()
