"""Fit the length family to the LobRA presets and print the reached statistics.

    python scripts/fit_length_presets.py           # refit: params literals + table
    python scripts/fit_length_presets.py --stored  # the stored presets: write their pmfs, print the table

The printed ``params=(...)`` literals go into ``lorafleet/specs/length_presets.py``; then ``--stored``
evaluates their pmfs into ``lorafleet/specs/length_presets.npz`` (what loading a preset reads). The
markdown table (reached mean/skewness/kurtosis of the truncated pmf vs the published
figures) goes into ``docs/length_presets.md``.
"""

from __future__ import annotations

import argparse
import time

from lorafleet.specs.length_family import fit_params
from lorafleet.specs.length_presets import LOBRA_DATASETS, PMF_FILE, DatasetPreset, preset_distribution, write_pmfs
from lorafleet.specs.lengths import LengthDistribution


def _row(preset: DatasetPreset, dist: LengthDistribution) -> str:
    """One markdown row: targets, reached figures and relative errors."""
    mean_err = dist.mean / preset.mean - 1.0
    skew_err = dist.skewness / preset.skewness - 1.0
    return (
        f"| {preset.id} | {preset.context_length} | {preset.mean:g} | {dist.mean:.1f} | "
        f"{mean_err:+.2%} | {preset.skewness:g} | {dist.skewness:.3f} | {skew_err:+.2%} | "
        f"{preset.kurtosis:g} | {dist.kurtosis:.2f} |"
    )


def main() -> None:
    """Print params literals (unless ``--stored``) and the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", action="store_true", help="use the stored params, no fit; write their pmfs")
    args = parser.parse_args()
    if args.stored:
        write_pmfs()
        print(f"# wrote {PMF_FILE}")
    rows = []
    for preset in LOBRA_DATASETS.values():
        if args.stored:
            dist = preset_distribution(preset)
        else:
            start = time.perf_counter()
            params = fit_params(preset.mean, preset.skewness, preset.kurtosis, preset.context_length)
            print(f"# {preset.id}: fitted in {time.perf_counter() - start:.2f} s")
            print(f"params=({', '.join(repr(v) for v in params)}),")
            dist = LengthDistribution.from_params(params, preset.context_length)
        rows.append(_row(preset, dist))
    print()
    print("| id | context | mean | reached | err | skew | reached | err | kurt | reached |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
