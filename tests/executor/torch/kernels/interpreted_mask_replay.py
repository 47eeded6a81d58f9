"""The keep-mask drawn again in the backward, on the Triton backend in Triton's interpreter (fp32, CPU).

Not collected by the normal run (the name does not start with ``test_``): ``test_dropout_replay.py`` runs it in a
fresh process with TRITON_INTERPRET=1 set before triton loads (why: ``interpreted_segment_lora.py``'s doc).
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run through tests/executor/torch/test_dropout_replay.py (needs TRITON_INTERPRET=1 first)")

import pytest

from lorafleet.executor.torch.routing import LoraBackend
from lorafleet.executor.torch.token_split import TokenSplit
from tests.executor.torch import mask_replay_cases as cases


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_triton_gradients_equal_those_of_the_kept_mask(recompute, monkeypatch):
    """As ``test_dropout_replay.test_gradients_equal_those_of_the_kept_mask``, on the Triton kernels."""
    cases.replay_against_kept(LoraBackend.TRITON, recompute, monkeypatch)


def test_a_triton_token_split_rank_reads_the_replayed_mask(monkeypatch):
    """As ``test_dropout_replay.test_a_token_split_rank_reads_the_replayed_mask``, rank 1 of 2, on the Triton
    kernels (its weight-gradient kernel over the rank's rows and their mask)."""
    cases.replay_against_kept(LoraBackend.TRITON, False, monkeypatch, TokenSplit(1, 2, None))


def test_a_triton_replay_from_another_state_is_caught(monkeypatch):
    """As ``test_dropout_replay.test_a_replay_from_another_state_is_caught``, on the Triton kernels."""
    changed = cases.perturbed_replay_is_caught(LoraBackend.TRITON, monkeypatch)
    assert changed == {"x", "lora_A.0", "lora_A.1", "lora_A.2"}
