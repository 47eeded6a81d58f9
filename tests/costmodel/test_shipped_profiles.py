"""The profiles shipped in profiles/: readable, reproducible, documented, and as accurate as claimed."""

from __future__ import annotations

import importlib.util

from lorafleet.costmodel.build import profile_cost_model
from lorafleet.costmodel.check import heldout_comparisons, summarize
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.profile_format import read_profile
from lorafleet.specs.model import resolve_model
from tests.helpers.repo import REPO

PROFILES = REPO / "profiles"
MEASURED = PROFILES / "tiny-llama-cpu.json"


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_analytic_profiles", REPO / "scripts" / "make_analytic_profiles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_profile_loads_and_is_documented():
    readme = (PROFILES / "README.md").read_text()
    files = sorted(PROFILES.glob("*.json"))
    assert MEASURED in files and len(files) > 10
    for path in files:
        profile = read_profile(path)
        cm = profile_cost_model(profile, resolve_model(profile.model))
        assert cm.configs, path
        assert path.name in readme, f"{path.name} is not named in profiles/README.md"


def test_analytic_profiles_are_what_the_script_makes():
    made = _script().profiles()
    shipped = {p.name for p in PROFILES.glob("*-analytic.json")}
    assert shipped == set(made)
    for name, profile in made.items():
        assert read_profile(PROFILES / name) == profile, (
            f"{name} is stale: run python scripts/make_analytic_profiles.py"
        )


def test_measured_cpu_profile_predicts_held_out_steps():
    """Issue bar: the fitted model predicts held-out measured replica steps (mixed micro-batch lists)
    on this CPU within 10% median relative error."""
    profile = read_profile(MEASURED)
    assert {r.tp for r in profile.records.layer} == {1, 2}
    assert {r.config for r in profile.memory} == {
        ParallelConfig(1, 1),
        ParallelConfig(1, 2),
        ParallelConfig(2, 1),
        ParallelConfig(2, 2),
    }
    summary = summarize(heldout_comparisons(profile, resolve_model(profile.model)))
    replica = summary["heldout_replica"]
    assert replica.n >= 10
    assert replica.median <= 0.10, replica
    mixed = [r for r in profile.records.replica if len({m.packed is None for m in r.microbatches}) == 2]
    assert mixed, "held-out steps should mix padded and packed micro-batches"
