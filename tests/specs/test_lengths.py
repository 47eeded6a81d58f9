"""Sequence-length distributions: empirical constructors, moment fit, LobRA presets."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from lorafleet.specs.length_family import family_pmf, fit_params
from lorafleet.specs.length_presets import (
    LOBRA_DATASETS,
    PMF_FILE,
    find_preset,
    preset_distribution,
    write_pmfs,
)
from lorafleet.specs.lengths import LengthDistribution

PRESETS = list(LOBRA_DATASETS.values())


def small() -> LengthDistribution:
    """P(1) = P(2) = 1/4, P(4) = 1/2."""
    return LengthDistribution.from_histogram({1: 1, 2: 1, 4: 2})


# ---------------------------------------------------------------------- presets
@pytest.mark.parametrize("preset", PRESETS, ids=[p.id for p in PRESETS])
def test_preset_matches_published_moments(preset):
    dist = preset_distribution(preset)
    assert dist.lengths[0] >= 1 and dist.max_length <= preset.context_length
    assert dist.mean == pytest.approx(preset.mean, rel=0.02)
    assert dist.skewness == pytest.approx(preset.skewness, rel=0.10)
    # Kurtosis is best effort (see docs/length_presets.md); raw kurtosis within 15 %.
    assert dist.kurtosis + 3 == pytest.approx(preset.kurtosis + 3, rel=0.15)


@pytest.mark.parametrize("preset", PRESETS, ids=[p.id for p in PRESETS])
def test_stored_params_are_what_the_fit_gives(preset):
    """Fails when the fitter changed without rerunning scripts/fit_length_presets.py."""
    params = fit_params(preset.mean, preset.skewness, preset.kurtosis, preset.context_length)
    refit = LengthDistribution.from_params(params, preset.context_length)
    stored = preset_distribution(preset)
    assert refit.mean == pytest.approx(stored.mean, rel=1e-3)
    assert refit.skewness == pytest.approx(stored.skewness, rel=1e-3)
    assert refit.kurtosis == pytest.approx(stored.kurtosis, rel=1e-2)


def test_find_preset_by_id_or_full_name():
    assert len(LOBRA_DATASETS) == 12
    assert find_preset("xsum") is LOBRA_DATASETS["xsum"]
    assert find_preset(" Magicoder-Evol-Instruct-110K ") is LOBRA_DATASETS["evol-instruct"]
    assert find_preset("DATABRICKS-DOLLY-15K") is LOBRA_DATASETS["dolly"]
    assert find_preset("no-such-dataset") is None


@pytest.mark.parametrize("preset", PRESETS, ids=[p.id for p in PRESETS])
def test_shipped_pmf_is_the_family_at_the_stored_params(preset):
    """length_presets.npz holds exactly what the params give (rerun fit_length_presets.py --stored if not)."""
    stored = preset_distribution(preset)
    evaluated = LengthDistribution.from_params(preset.params, preset.context_length)
    assert np.array_equal(stored.lengths, evaluated.lengths)
    assert np.array_equal(stored.probs, evaluated.probs)


def test_a_preset_whose_params_changed_names_the_stale_file(tmp_path, monkeypatch):
    import lorafleet.specs.length_presets as presets

    stale = tmp_path / "stale.npz"
    write_pmfs(stale)
    monkeypatch.setattr(presets, "PMF_FILE", stale)
    moved = dataclasses.replace(LOBRA_DATASETS["xsum"], params=(1.0, 1.0, 5.0, 0.0))
    with pytest.raises(RuntimeError, match=r"stale\.npz: no pmf of preset 'xsum' for its params"):
        preset_distribution(moved)
    assert PMF_FILE.name == "length_presets.npz"


def test_loading_the_presets_imports_no_scipy():
    """A plan of presets skips scipy.special's 0.2 s of imports (issue #26)."""
    code = (
        "import sys; from lorafleet.specs.length_presets import LOBRA_DATASETS, preset_distribution; "
        "[preset_distribution(p) for p in LOBRA_DATASETS.values()]; "
        "print(sorted(m for m in sys.modules if m.startswith('scipy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_preset_distribution_is_cached_and_read_only():
    preset = LOBRA_DATASETS["meetingbank"]
    dist = preset_distribution(preset)
    assert preset_distribution(preset) is dist
    with pytest.raises(ValueError):
        dist.probs[0] = 0.5


# ---------------------------------------------------------------------- the family
@pytest.mark.parametrize("params", [(2.0, 1.5, 5.0, 0.01), (3.0, -1.2, 6.0, 0.0)])
def test_family_pmf_is_discretised_truncated_gengamma(params):
    a, c, log_scale, w = params
    ctx = 1024
    pmf = family_pmf(params, ctx)
    cdf = stats.gengamma.cdf(np.arange(1, ctx) + 0.5, a, c, scale=np.exp(log_scale))
    assert pmf.sum() == pytest.approx(1.0, abs=1e-12)
    assert pmf[0] == pytest.approx((1 - w) * cdf[0], rel=1e-9)
    np.testing.assert_allclose(pmf[1:-1], (1 - w) * np.diff(cdf), rtol=1e-6, atol=1e-15)
    assert pmf[-1] == pytest.approx((1 - w) * (1 - cdf[-1]) + w, rel=1e-9, abs=1e-15)


def test_family_pmf_rejects_bad_params():
    with pytest.raises(ValueError):
        family_pmf((1.0, 1.0, 5.0), 100)
    with pytest.raises(ValueError):
        family_pmf((1.0, 0.0, 5.0, 0.0), 100)
    with pytest.raises(ValueError):
        family_pmf((1.0, 1.0, 5.0, 1.0), 100)


# ---------------------------------------------------------------------- from_moments
@pytest.mark.parametrize(
    "mean, skew, kurt, ctx",
    [(300.0, 2.0, 8.0, 4096), (1500.0, 1.2, 2.5, 16384), (40.0, 0.3, -0.2, 128)],
)
def test_from_moments_round_trip(mean, skew, kurt, ctx):
    dist = LengthDistribution.from_moments(mean, skew, kurt, ctx)
    assert dist.max_length <= ctx
    assert dist.mean == pytest.approx(mean, rel=0.02)
    assert dist.skewness == pytest.approx(skew, rel=0.10)
    again = LengthDistribution.from_moments(mean, skew, kurt, ctx)
    np.testing.assert_array_equal(again.probs, dist.probs)  # deterministic


@pytest.mark.parametrize(
    "mean, skew, kurt, ctx",
    [
        (5000.0, 1.0, 1.0, 4096),  # mean beyond the context
        (100.0, 3.0, 5.0, 4096),  # kurtosis below skew**2 - 2: no distribution
        (100.0, 1.0, 1.0, 1),  # no room for a shape
    ],
)
def test_from_moments_rejects_infeasible_targets(mean, skew, kurt, ctx):
    with pytest.raises(ValueError):
        LengthDistribution.from_moments(mean, skew, kurt, ctx)


def test_from_moments_reports_targets_outside_the_family():
    # Feasible (a spike at length 1 under a bulk near 100), but the family has no such spike.
    with pytest.raises(ValueError, match="cannot match"):
        LengthDistribution.from_moments(100.0, -50.0, 2500.0, 512)


# ---------------------------------------------------------------------- sampling
def test_sample_is_deterministic_and_converges():
    dist = preset_distribution(LOBRA_DATASETS["dolly"])
    first = dist.sample(100_000, np.random.default_rng(7))
    second = dist.sample(100_000, np.random.default_rng(7))
    np.testing.assert_array_equal(first, second)
    assert first.dtype == np.int64
    assert set(np.unique(first)) <= set(dist.lengths.tolist())
    assert first.mean() == pytest.approx(dist.mean, abs=5 * dist.std / np.sqrt(first.size))
    assert dist.sample(0, np.random.default_rng(0)).shape == (0,)
    with pytest.raises(ValueError):
        dist.sample(-1, np.random.default_rng(0))


def test_expected_tokens():
    assert small().expected_tokens(8) == pytest.approx(8 * 2.75)


# ---------------------------------------------------------------------- context limits
def test_truncate_moves_tail_mass_to_the_context_length():
    dist = LengthDistribution.from_histogram({10: 1, 20: 2, 30: 3, 40: 4})
    cut = dist.truncate(25)
    np.testing.assert_array_equal(cut.lengths, [10, 20, 25])
    np.testing.assert_allclose(cut.probs, [0.1, 0.2, 0.7])
    assert cut.probs.sum() == pytest.approx(1.0)
    assert dist.truncate(30).lengths.tolist() == [10, 20, 30]
    assert dist.truncate(30).probs[-1] == pytest.approx(0.7)
    assert dist.truncate(100) is dist
    with pytest.raises(ValueError):
        dist.truncate(0)


def test_reject_above_drops_and_renormalises():
    dist = LengthDistribution.from_histogram({10: 1, 20: 2, 30: 3, 40: 4})
    kept, rejected = dist.reject_above(30)
    assert rejected == pytest.approx(0.4)
    np.testing.assert_array_equal(kept.lengths, [10, 20, 30])
    np.testing.assert_allclose(kept.probs, [1 / 6, 2 / 6, 3 / 6])
    assert dist.reject_above(40)[1] == 0.0
    with pytest.raises(ValueError, match="every length"):
        dist.reject_above(9)


# ---------------------------------------------------------------------- quantile
@pytest.mark.parametrize("q, expected", [(0.0, 1), (0.25, 1), (0.26, 2), (0.5, 2), (0.51, 4), (1.0, 4)])
def test_quantile_is_smallest_length_with_cdf_at_least_q(q, expected):
    assert small().quantile(q) == expected


@pytest.mark.parametrize("q", [-0.1, 1.1])
def test_quantile_rejects_levels_outside_unit_interval(q):
    with pytest.raises(ValueError):
        small().quantile(q)


# ---------------------------------------------------------------------- constructors
def test_from_samples_and_from_histogram_agree():
    from_samples = LengthDistribution.from_samples([4, 1, 4, 2])
    np.testing.assert_array_equal(from_samples.lengths, small().lengths)
    np.testing.assert_allclose(from_samples.probs, small().probs)
    floats = LengthDistribution.from_samples(np.array([4.0, 1.0, 4.0, 2.0]))
    np.testing.assert_allclose(floats.probs, small().probs)
    dropped = LengthDistribution.from_histogram({3: 0.0, 5: 2.5})
    assert dropped.lengths.tolist() == [5] and dropped.probs.tolist() == [1.0]


@pytest.mark.parametrize("values", [[], [0, 3], [1.5, 2.0], [float("nan")], ["a"]], ids=repr)
def test_from_samples_rejects_bad_values(values):
    with pytest.raises(ValueError):
        LengthDistribution.from_samples(values)


@pytest.mark.parametrize(
    "counts",
    [{}, {0: 1.0}, {2: -1.0, 3: 2.0}, {2: 0.0}, {2.5: 1.0}, {2: float("inf")}],
    ids=repr,
)
def test_from_histogram_rejects_bad_counts(counts):
    with pytest.raises(ValueError):
        LengthDistribution.from_histogram(counts)


@pytest.mark.parametrize(
    "lengths, probs",
    [
        ([2, 1], [0.5, 0.5]),  # not increasing
        ([1, 1], [0.5, 0.5]),  # duplicate
        ([0, 1], [0.5, 0.5]),  # below 1
        ([1.0, 2.0], [0.5, 0.5]),  # not integers
        ([1, 2], [0.5, 0.6]),  # does not sum to 1
        ([1, 2], [1.0, 0.0]),  # zero probability
        ([1, 2], [0.5]),  # shape mismatch
        ([], []),  # empty
    ],
)
def test_validation_rejects_malformed_arrays(lengths, probs):
    with pytest.raises(ValueError):
        LengthDistribution(np.array(lengths), np.array(probs))


def test_point_mass_has_undefined_shape():
    dist = LengthDistribution.from_samples([7, 7, 7])
    assert dist.mean == 7 and dist.std == 0 and dist.quantile(0.5) == 7
    assert np.isnan(dist.skewness) and np.isnan(dist.kurtosis)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.integers(min_value=1, max_value=20_000),
        st.integers(min_value=1, max_value=50),
        min_size=2,
        max_size=40,
    )
)
def test_moments_agree_with_numpy_on_expanded_samples(counts):
    dist = LengthDistribution.from_histogram(counts)
    samples = np.repeat(np.array(list(counts), dtype=np.float64), list(counts.values()))
    assert dist.mean == pytest.approx(samples.mean(), rel=1e-12)
    assert dist.std == pytest.approx(samples.std(), rel=1e-9)
    assert dist.skewness == pytest.approx(stats.skew(samples), rel=1e-7, abs=1e-9)
    assert dist.kurtosis == pytest.approx(stats.kurtosis(samples), rel=1e-7, abs=1e-9)
    assert dist.max_length == max(counts)
