"""The cyclic collector's policy of every command and rank (``runtime.gc_policy``)."""

from __future__ import annotations

import gc

import pytest

from lorafleet.runtime.gc_policy import GC_GEN0_THRESHOLD, fewer_collections


def test_the_young_threshold_is_raised_meanwhile_and_restored_after_even_on_error():
    before = gc.get_threshold()
    with fewer_collections():
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, *before[1:])
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("out of the block")
    assert gc.get_threshold() == before


def test_a_command_runs_under_it(monkeypatch):
    """``cli.main`` runs the command under the policy (what rank 0's dispatch gets too: ``train.rank``)."""
    from lorafleet import cli

    seen = []
    monkeypatch.setattr(cli, "_run", lambda argv: seen.append(gc.get_threshold()[0]) or 0)
    assert cli.main(["--version-free"]) == 0 and seen == [GC_GEN0_THRESHOLD]
