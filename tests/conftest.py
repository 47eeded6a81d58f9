"""Fixtures of the whole suite: the reference data, the project's tiny tokenizer, the small workload planned.

Paths and shared data that tests import are in :mod:`tests.helpers`, not here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from lorafleet.data.length_cache import CACHE_ENV
from tests.helpers.repo import REFERENCE, SMALL_WORKLOAD

# No per-example deadline: Hypothesis times each example by the wall clock, and on a 2-core machine
# beside the other test worker's process groups a trivial example can take longer than its 200 ms.
# The suite's examples are derandomized (the same every run): a property that fails fails in every run,
# not in one CI run of twenty. `pytest --hypothesis-profile=explore` draws fresh examples to hunt with
# (a counterexample it finds belongs in the test as an @example).
settings.register_profile("lorafleet", deadline=None, derandomize=True)
settings.register_profile("explore", deadline=None)
settings.load_profile("lorafleet")


@pytest.fixture(scope="session", autouse=True)
def _length_cache(tmp_path_factory: pytest.TempPathFactory):
    """The token-length cache (``data/length_cache.py``) of this test session: a fresh directory, not the
    user's ``~/.cache/lorafleet``, so no test reads lengths an earlier run or another checkout left there;
    set in the environment, so the runs a test launches share it."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("length-cache")))
        yield


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """``../shared/reference`` (LobRA's published data); tests that need it skip without it."""
    if not REFERENCE.is_dir():
        pytest.skip("../shared/reference is absent (LobRA reference data is not part of the repository)")
    return REFERENCE


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's own small BPE tokenizer, built once per test session."""
    from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer_with_template(tiny_tokenizer_dir, tmp_path_factory):
    """Factory: ``tokenizer_with_template(template)``, the directory of the project's tiny tokenizer carrying
    ``template`` as its chat template (None: none at all)."""
    from transformers import AutoTokenizer

    def make(template: str | None) -> Path:
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
        tokenizer.chat_template = template
        out = tmp_path_factory.mktemp("templated-tokenizer")
        tokenizer.save_pretrained(out)
        return out

    return make


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(workload, cost model, planning result) of ``SMALL_WORKLOAD``; the cost model is the one the plan was
    judged by (its pipeline window). The simulation tests' common input, planned once per test module."""
    import yaml

    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.planner import plan_deployment
    from lorafleet.workload import load_workload

    path = tmp_path_factory.mktemp("w") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL_WORKLOAD))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    result = plan_deployment(workload, cluster, workload_cost_model(workload, cluster))
    return workload, result.cost_model, result
