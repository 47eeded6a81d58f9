"""Write the service-scale example workloads: many tenants from LobRA's twelve dataset presets.

    python scripts/make_service_examples.py [--out examples]

``examples/service-64.yaml`` and ``examples/service-128.yaml``: Llama2-70B on 1,024 A800-80GB GPUs
(128 nodes of 8), as ``examples/lobra-70b.yaml`` but with 64 or 128 tenants. Tenant k fine-tunes
on preset ``k mod 12`` (its published lengths and context length) with a global batch of
16, 32, 64 or 128 sequences: ``BATCH_SIZES[(k + k // 12) mod 4]``, so every preset meets every
batch size and each size is taken by a quarter of the tenants (3,840 and 7,680 sequences a step).
``examples/service-sweeps.yaml``: the same service's 64 tasks, each a 16-member hyperparameter sweep (4 learning
rates x 4 ranks, halved with eta 4 every 100 steps) at a quarter of its batch size: 1,024 tenants, 15,360 sequences
a step, on the same 1,024 GPUs.
Nothing is random: the files are the same on every run, and the planner reads them as written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lorafleet.specs.length_presets import LOBRA_DATASETS

BATCH_SIZES = (16, 32, 64, 128)
TENANTS = (64, 128)
NODES = 128
GPUS_PER_NODE = 8


def tenants(n: int) -> list[tuple[str, str, int]]:
    """(name, preset, batch size) of each of ``n`` tenants."""
    presets = list(LOBRA_DATASETS)  # LobRA's order, as examples/lobra-70b.yaml lists them
    out = []
    for k in range(n):
        preset = presets[k % len(presets)]
        out.append((f"t{k:03d}-{preset}", preset, BATCH_SIZES[(k + k // len(presets)) % len(BATCH_SIZES)]))
    return out


SWEEP = (
    "sweep: {grid: {optimizer.lr: [5.0e-5, 1.0e-4, 2.0e-4, 4.0e-4], lora.rank: [8, 16, 32, 64]}, "
    "halving: {eta: 4, rung_steps: 100}}"
)
"""Each task's sweep in ``service-sweeps.yaml``: 16 members."""
SWEEP_MEMBERS = 16


def workload_yaml(n: int, sweeps: bool = False) -> str:
    rows = tenants(n)
    if sweeps:
        rows = [(name, preset, b // 4) for name, preset, b in rows]
    total = sum(b for _, _, b in rows) * (SWEEP_MEMBERS if sweeps else 1)
    what = f"{n} tasks, each a {SWEEP_MEMBERS}-member sweep ({n * SWEEP_MEMBERS} tenants)" if sweeps else f"{n} tenants"
    lines = [
        f"# A fine-tuning service: {what} on Llama2-70B, {NODES * GPUS_PER_NODE} x A800-80GB "
        f"({NODES} nodes of {GPUS_PER_NODE}), {total} sequences a step.",
        "# Written by scripts/make_service_examples.py ("
        + (
            "task k: LobRA preset k mod 12, batch 16-128, a quarter of it a member"
            if sweeps
            else "tenant k: LobRA preset k mod 12, batch 16-128"
        )
        + "); do not edit by hand.",
        "model: llama2-70b",
        f"cluster: {{gpu: A800-80GB, nodes: {NODES}, gpus_per_node: {GPUS_PER_NODE}}}",
        "recompute: auto",
        "seed: 0",
        "defaults:",
        "  lora: {rank: 16, alpha: 16}",
        "  optimizer: {lr: 1.0e-4, weight_decay: 0.01}",
        "tasks:",
    ]
    if sweeps:
        lines += [
            f"  - {{name: {name}, preset: {preset}, batch_size: {b}, eval: {{split: 0.02, every_steps: 50}}, {SWEEP}}}"
            for name, preset, b in rows
        ]
    else:
        lines += [f"  - {{name: {name}, preset: {preset}, batch_size: {b}}}" for name, preset, b in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples", help="directory to write service-<n>.yaml into")
    args = parser.parse_args()
    for n in TENANTS:
        path = Path(args.out) / f"service-{n}.yaml"
        path.write_text(workload_yaml(n))
        print(f"wrote {path}")
    path = Path(args.out) / "service-sweeps.yaml"
    path.write_text(workload_yaml(TENANTS[0], sweeps=True))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
