"""The twelve LobRA fine-tuning datasets as offline sequence-length presets.

Each preset carries the dataset's published length statistics (LobRA paper and artifact;
``shared/reference/README.md``): mean, skewness and excess kurtosis of the token lengths
after truncation to ``context_length``, and the dataset's published row count where one is published
(``docs/length_presets.md`` cites each). It also carries the parameters
``(a, c, log_scale, tail_mass)`` of the :mod:`lorafleet.specs.length_family` family fitted to
them. The fit runs offline (``python scripts/fit_length_presets.py``) and is written here
as literals. The pmfs those params give are shipped beside this module
(``length_presets.npz``, written by ``scripts/fit_length_presets.py --stored``): loading a preset
reads its pmf instead of evaluating the family, so planning a workload of presets never imports
``scipy.special`` (0.2 CPU s of a 5 s plan). Reached figures: ``docs/length_presets.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lorafleet.specs.length_family import family_pmf
from lorafleet.specs.lengths import LengthDistribution

PMF_FILE = Path(__file__).with_name("length_presets.npz")
"""Per preset id: ``<id>`` its pmf over ``1..context_length`` (float64), ``<id>.params`` the params it
was evaluated from."""


@dataclass(frozen=True)
class DatasetPreset:
    """One dataset: published length statistics, LobRA batch size and context length."""

    id: str
    """Short name used in configs (``"xsum"``)."""
    full_name: str
    """The dataset's name as published (``"XSum"``)."""
    mean: float
    """Mean token length after truncation to ``context_length``."""
    skewness: float
    """Skewness of the truncated lengths."""
    kurtosis: float
    """Excess (Fisher) kurtosis of the truncated lengths."""
    batch_size: int
    """Global batch size (sequences per step) in the LobRA experiments."""
    context_length: int
    """Context length the dataset is truncated to."""
    params: tuple[float, ...]
    """Fitted ``(a, c, log_scale, tail_mass)`` of the length family; written by
    ``scripts/fit_length_presets.py``."""
    rows: int | None = None
    """The dataset's published row count (its training split where it publishes splits; a rounded figure where
    the source gives only that: ``docs/length_presets.md``, "Row counts"), None where none is published for the
    data LobRA trained on. A what-if holds out ``round(split x rows)`` of a preset task for its evaluations
    (``eval_replay.held_out_rows``)."""


_PRESETS = (
    DatasetPreset(
        "dolly",
        "databricks-dolly-15k",
        207.0,
        7.11,
        95.43,
        256,
        8192,
        params=(
            10000.00000000001,
            0.008658563726178426,
            -1059.0522036428592,
            3.3273736649101546e-05,
        ),
        rows=15_011,
    ),
    DatasetPreset(
        "python-code",
        "python_code_instructions_18k",
        269.0,
        10.01,
        121.55,
        128,
        16384,
        params=(
            0.3468104584937852,
            -2.452072085825347,
            2.9602150104143075,
            0.0,
        ),
        rows=18_612,
    ),
    DatasetPreset(
        "evol-instruct",
        "Magicoder-Evol-Instruct-110K",
        702.0,
        6.59,
        80.28,
        128,
        16384,
        params=(
            10000.00000000001,
            0.010419043396606079,
            -877.9057624335057,
            0.0006598481328591329,
        ),
        rows=111_000,
    ),
    DatasetPreset(
        "commitpackft",
        "CommitPackFT",
        663.0,
        0.79,
        1.68,
        128,
        8192,
        params=(
            10000.00000000001,
            0.0394713047247174,
            -226.87671619329947,
            1.562076925828855e-07,
        ),
        rows=None,
    ),
    DatasetPreset(
        "mathinstruct",
        "MathInstruct",
        252.0,
        3.03,
        12.72,
        128,
        8192,
        params=(
            2.240937359887394,
            0.5987160831416148,
            3.9678226681986555,
            0.0,
        ),
        rows=262_000,
    ),
    DatasetPreset(
        "metamathqa",
        "MetaMathQA",
        236.0,
        2.56,
        14.56,
        128,
        4096,
        params=(
            10000.00000000001,
            -0.015802938689227622,
            588.0844327031125,
            7.5323756242605505e-06,
        ),
        rows=395_000,
    ),
    DatasetPreset(
        "numinamath-cot",
        "NuminaMath-CoT",
        543.0,
        1.52,
        3.51,
        256,
        8192,
        params=(
            1.9542136804400478,
            0.9603625027382742,
            5.589447324860034,
            0.0,
        ),
        rows=859_494,
    ),
    DatasetPreset(
        "pubmedqa",
        "PubMedQA",
        371.0,
        0.73,
        3.29,
        64,
        2048,
        params=(
            10000.00000000001,
            -0.05058185073346468,
            187.98345949887099,
            1.0211160079023692e-05,
        ),
        rows=None,
    ),
    DatasetPreset(
        "xsum",
        "XSum",
        526.0,
        7.49,
        371.8,
        128,
        16384,
        params=(
            10000.00000000001,
            0.021932621388156288,
            -413.7750566033734,
            2.9320727558721522e-05,
        ),
        rows=204_045,
    ),
    DatasetPreset(
        "billsum",
        "BillSum",
        3903.0,
        0.85,
        0.3,
        32,
        16384,
        params=(
            0.43287542938774437,
            2.3101334289506616,
            8.892420597890544,
            0.0,
        ),
        rows=18_949,
    ),
    DatasetPreset(
        "cnn-dailymail",
        "cnn_dailymail",
        947.0,
        0.89,
        0.64,
        256,
        8192,
        params=(
            0.582231697863387,
            2.0136159866523657,
            7.320077366548169,
            0.0,
        ),
        rows=287_113,
    ),
    DatasetPreset(
        "meetingbank",
        "MeetingBank",
        3622.0,
        4.35,
        26.5,
        64,
        16384,
        params=(
            10000.00000000001,
            -0.030828136022034127,
            306.85682162125113,
            0.013065429636307881,
        ),
        rows=6_892,
    ),
)

#: The presets keyed by id.
LOBRA_DATASETS: dict[str, DatasetPreset] = {preset.id: preset for preset in _PRESETS}


def find_preset(name: str) -> DatasetPreset | None:
    """The preset whose id or full name equals ``name`` (case-insensitive), else None."""
    key = name.strip().casefold()
    return next((p for p in _PRESETS if key in (p.id.casefold(), p.full_name.casefold())), None)


@functools.cache
def preset_distribution(preset: DatasetPreset) -> LengthDistribution:
    """The preset's length distribution on ``1..context_length``: its pmf from :data:`PMF_FILE`, which
    :func:`write_pmfs` evaluated from the same params (raises when they differ: a stale file)."""
    with np.load(PMF_FILE) as stored:
        if preset.id not in stored or not np.array_equal(stored[f"{preset.id}.params"], preset.params):
            raise RuntimeError(
                f"{PMF_FILE}: no pmf of preset {preset.id!r} for its params; "
                "run python scripts/fit_length_presets.py --stored"
            )
        return LengthDistribution.from_pmf(stored[preset.id])


def write_pmfs(path: Path = PMF_FILE) -> None:
    """Evaluate every preset's pmf from its params (:func:`family_pmf`, scipy's incomplete gamma) into ``path``."""
    arrays: dict[str, np.ndarray] = {}
    for preset in _PRESETS:
        arrays[preset.id] = family_pmf(preset.params, preset.context_length)
        arrays[f"{preset.id}.params"] = np.array(preset.params)
    np.savez_compressed(path, **arrays)
