"""Regenerate the analytic profiles in profiles/: every GPU preset x the LobRA base models.

    python scripts/make_analytic_profiles.py [--out-dir profiles]

Each file holds the analytic cost model (DEFAULT_CALIBRATION) of one model on one GPU kind
for LobRA's adapter load (6 tasks, rank 16, every projection, AdamW) on 8 nodes of 8 GPUs,
so every config of up to 64 GPUs is listed. ``cpu`` is left out: its datasheet figures are
nominal, and profiles/tiny-llama-cpu.json holds measurements of this machine instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.build import analytic_profile
from lorafleet.costmodel.profile_format import Profile, write_profile
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.gpus import GPU_PRESETS
from lorafleet.specs.model import MODEL_PRESETS

MODELS = ("llama2-7b", "llama2-70b")
GPUS = tuple(name for name in GPU_PRESETS if name != "cpu")
ADAPTERS = AdapterLoad.uniform(6, 16)
NODES, GPUS_PER_NODE = 8, 8
COMMAND = "python scripts/make_analytic_profiles.py"


def file_name(model: str, gpu: str) -> str:
    return f"{model}-{gpu.lower()}-analytic.json"


def profiles() -> dict[str, Profile]:
    """Every analytic profile by file name."""
    out = {}
    for model in MODELS:
        for gpu in GPUS:
            cluster = ClusterSpec(gpu=gpu, nodes=NODES, gpus_per_node=GPUS_PER_NODE)
            out[file_name(model, gpu)] = analytic_profile(MODEL_PRESETS[model], cluster, ADAPTERS, command=COMMAND)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "profiles"))
    args = parser.parse_args()
    for name, profile in profiles().items():
        write_profile(profile, Path(args.out_dir) / name)
        print(f"wrote {Path(args.out_dir) / name}")


if __name__ == "__main__":
    main()
