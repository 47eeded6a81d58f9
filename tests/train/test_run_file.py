"""The run file (``train.run_file``) carries what the launcher resolved, so that a rank redoes none of it: each
task's token-length histogram among it, so a rank starts without tokenizing any data for its lengths."""

from __future__ import annotations

import numpy as np

from lorafleet.data.length_cache import CACHE_ENV
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import prepare
from lorafleet.train.run_file import ResolvedRun
from lorafleet.work import counting
from tests.helpers.queue_fleet import on_four_gpus


def test_a_rank_resolves_the_workload_from_the_run_file_without_tokenizing(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """The launcher tokenizes each task once for its lengths (the token cache cold); a rank reading ``run.json``
    tokenizes none for them (its lengths are the launcher's, bit for bit), and building its data streams none
    either: the launcher's tokenization is the cache's, and the streams' examples are a fresh tokenization's."""
    from lorafleet.runtime.data_stream import training_streams

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "planning-cache"))
    path, profile = on_four_gpus(tmp_path, tiny_tokenizer_dir, slots=(0, 3))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # cold: the planning's tokenizations are not in it
    options = TrainOptions(
        workload=str(path), plan=str(path.with_suffix(".plan.json")), out=str(tmp_path / "out"), profile=str(profile)
    )
    with counting() as launcher:
        prepared = prepare(options)
    assert launcher["tokenizations"] == len(prepared.workload.tasks) == 2
    ResolvedRun.of(options, prepared).save(options.run_dir)
    run = ResolvedRun.load(options.run_dir.run_file)
    assert sorted(run.state.lengths) == ["chat", "docsum"]
    with counting() as rank:
        mine = run.prepared()
    assert rank["tokenizations"] == 0
    for theirs, ours in zip(prepared.workload.tasks, mine.workload.tasks, strict=True):
        assert np.array_equal(theirs.raw_lengths.lengths, ours.raw_lengths.lengths)
        assert theirs.raw_lengths.probs.tobytes() == ours.raw_lengths.probs.tobytes()
        assert theirs.lengths.probs.tobytes() == ours.lengths.probs.tobytes()
    with counting() as streams:
        cached = training_streams(mine.workload.spec, options.steps)
    assert streams["tokenizations"] == 0
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "fresh-cache"))
    with counting() as streams:
        fresh = training_streams(mine.workload.spec, options.steps)
    assert streams["tokenizations"] == 2
    for ours, theirs in zip(cached.streams, fresh.streams, strict=True):
        assert ours.data == theirs.data


def test_a_histogram_gives_the_samples_distribution_bit_for_bit():
    """``workload.length_histogram`` then ``from_histogram`` is ``from_samples``: what makes the run file's
    lengths the launcher's exactly."""
    from lorafleet.specs.lengths import LengthDistribution
    from lorafleet.workload import length_histogram

    rng = np.random.default_rng(0)
    for n in (1, 7, 1_000, 100_003):
        values = rng.integers(1, 4_096, size=n)
        a = LengthDistribution.from_samples(values)
        b = LengthDistribution.from_histogram(length_histogram(values))
        assert np.array_equal(a.lengths, b.lengths) and a.probs.tobytes() == b.probs.tobytes()
