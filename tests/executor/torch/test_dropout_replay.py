"""The adapter-dropout keep-mask is not saved for the backward: the backward draws it again from the generator state
the forward drew it from (``dropout.MaskReplay``). Gradients are bit for bit those of the forward's own mask kept
(the operator before), for LoRA, DoRA and rsLoRA, with and without recomputation, on the torch backend here and on
the Triton backend in its interpreter (``kernels/interpreted_mask_replay.py``); the global generator leaves the
forward as before; a replay from another state is caught; no ``(T, K)`` bool is among the saved tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lorafleet.executor.torch.dropout import MaskReplay, draw_keep_mask
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.routing import LoraBackend, LoraRouting, Segments
from lorafleet.executor.torch.token_split import TokenSplit
from lorafleet.specs.lora import LoraSpec
from tests.executor.torch import mask_replay_cases as cases
from tests.helpers.repo import REPO

ROUTING = LoraRouting(Segments.packed([0, 1, 0, 2], [300, 40, 700, 90]), (2.0, 1.0, 0.5), (0.1, 0.0, 0.25))


def test_the_replay_draws_the_forwards_mask_and_leaves_the_global_generator_alone():
    """``next_draw`` only reads the global generator; the draw after it is the draw without it (the same mask, the
    generator left in the same state); ``mask()`` gives that mask again, bit for bit, without moving the generator;
    a routing without dropout has no replay."""
    torch.manual_seed(5)
    plain = draw_keep_mask(1130, 33, ROUTING, device="cpu")
    after_plain = torch.get_rng_state()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    replay = MaskReplay.next_draw(1130, 33, ROUTING, torch.device("cpu"))
    assert replay is not None and torch.equal(torch.get_rng_state(), before)
    keep = draw_keep_mask(1130, 33, ROUTING, device="cpu")
    assert torch.equal(keep, plain) and torch.equal(torch.get_rng_state(), after_plain)
    assert torch.equal(replay.mask(), keep) and torch.equal(torch.get_rng_state(), after_plain)
    assert not keep[:300].all() and keep[300:340].all()
    assert replay.state.numel() == 5056  # the host's Mersenne Twister, in place of 1130 x 33 mask bytes
    no_dropout = LoraRouting(ROUTING.segments, ROUTING.scalings, (0.0, 0.0, 0.0))
    assert MaskReplay.next_draw(1130, 33, no_dropout, torch.device("cpu")) is None


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_gradients_equal_those_of_the_kept_mask(recompute, monkeypatch):
    """LoRA, DoRA and rsLoRA with dropout (and an adapter without) in one layer, torch backend: output, ``dX`` and
    every factor's gradient with the mask drawn again equal those with the forward's mask kept, bit for bit, and the
    global generator leaves the forward in the same state; under ``torch.utils.checkpoint`` too."""
    cases.replay_against_kept(LoraBackend.TORCH, recompute, monkeypatch)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_token_split_rank_reads_the_replayed_mask(rank, monkeypatch):
    """TP rank ``rank`` of 2 of a column-parallel layer (``token_split.py``: its rows of ``X`` saved, ``dA`` from
    them and their rows of the mask, ``dX`` from the whole mask), its ``dS'`` summed over itself alone: gradients
    with the mask drawn again equal those with the forward's mask kept, bit for bit, recomputed too."""
    cases.replay_against_kept(LoraBackend.TORCH, True, monkeypatch, TokenSplit(rank, 2, None))
    cases.replay_against_kept(LoraBackend.TORCH, False, monkeypatch, TokenSplit(rank, 2, None))


def test_a_replay_from_another_state_is_caught(monkeypatch):
    """The comparison above can fail: a replay drawn from its state moved by one word changes exactly what the
    backward's mask reaches: ``dX`` and the dropping adapters' ``dA``, not ``dB`` nor DoRA's ``dm`` (from the saved
    ``S`` and ``D``), nor the dropout-free adapter's."""
    changed = cases.perturbed_replay_is_caught(LoraBackend.TORCH, monkeypatch)
    assert changed == {"x", "lora_A.0", "lora_A.1", "lora_A.2"}


def _saved(layer: MultiLoraLinear, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensors one forward of ``layer`` saves for its backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return saved


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_no_keep_mask_is_saved(use_dora):
    """With dropout 0.3 a layer saves no bool tensor, and for LoRA the same bytes as without dropout (the input,
    ``S`` and the stacked factors): the ``(T, K)`` mask (one byte an element) is gone. DoRA's dropout term saves its
    ``(L, N)`` product ``D`` beside, no mask and no ``(T, K)`` float."""
    tokens, hidden = 64, 48

    def layer(dropout: float) -> MultiLoraLinear:
        torch.manual_seed(0)
        out = MultiLoraLinear(nn.Linear(hidden, 32)).train()
        out.add_adapter(0, LoraSpec(rank=4, alpha=8, dropout=dropout, use_dora=use_dora))
        out.segments = Segments.packed([0], [tokens])
        return out

    x = torch.randn(tokens, hidden, requires_grad=True)
    dropping, plain = _saved(layer(0.3), x), _saved(layer(0.0), x)
    assert not any(t.dtype == torch.bool for t in dropping)
    inputs = [t for t in dropping if t.shape == (tokens, hidden)]
    assert all(t.data_ptr() == x.data_ptr() for t in inputs)  # the input itself, no (T, K) float factor
    extra = tokens * 32 * 4 if use_dora else 0  # D (T, N), fp32
    assert sum(t.nbytes for t in dropping) == sum(t.nbytes for t in plain) + extra


def test_triton_gradients_equal_those_of_the_kept_mask():
    """The Triton backend in its interpreter (``kernels/interpreted_mask_replay.py``, a fresh process with
    TRITON_INTERPRET=1): the same comparisons as above, stored, recomputed and as a token-split rank, and the
    perturbed replay caught."""
    cases_file = Path(__file__).parent / "kernels" / "interpreted_mask_replay.py"
    command = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", str(cases_file)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout.splitlines()[-1]
    assert "4 passed" in summary and "skipped" not in summary, summary


@pytest.mark.parametrize("split", [None, 0, 1], ids=["whole", "tp-rank-0", "tp-rank-1"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_a_layer_keeping_its_masks_gets_the_replays_gradients(recompute, split, monkeypatch):
    """The layer as shipped both ways (no patch of the mask): keeping its masks (``mask_tokens`` = the call's rows)
    and drawing them again (one row fewer) give the same output, ``dX``, factor gradients and after-forward global
    generator state, bit for bit, stored and recomputed, whole and as either TP rank of a token split."""
    if split is not None:
        monkeypatch.setattr(TokenSplit, "reduce", cases.rank_rows_alone)
    runs = []
    for mask_tokens in (cases.ROWS, cases.ROWS - 1):
        net = cases.layer(LoraBackend.TORCH, None if split is None else TokenSplit(split, 2, None))
        net.mask_tokens = mask_tokens
        runs.append(cases.gradients(net, recompute))
    (kept, kept_state), (redrawn, redrawn_state) = runs
    cases.assert_bitwise_equal(redrawn, kept)
    assert torch.equal(redrawn_state, kept_state)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_a_call_up_to_mask_tokens_rows_keeps_its_mask(use_dora):
    """A call of at most ``mask_tokens`` rows saves its ``(T, K)`` bool mask (one byte an element) beside what a call
    one row over saves, and draws nothing in the backward; a call over it saves no bool."""
    tokens, hidden = 64, 48

    def layer(mask_tokens: int) -> MultiLoraLinear:
        torch.manual_seed(0)
        out = MultiLoraLinear(nn.Linear(hidden, 32)).train()
        out.add_adapter(0, LoraSpec(rank=4, alpha=8, dropout=0.3, use_dora=use_dora))
        out.segments = Segments.packed([0], [tokens])
        out.mask_tokens = mask_tokens
        return out

    x = torch.randn(tokens, hidden, requires_grad=True)
    kept, redrawn = _saved(layer(tokens), x), _saved(layer(tokens - 1), x)
    masks = [t for t in kept if t.dtype == torch.bool]
    assert len({t.data_ptr() for t in masks}) == 1 and masks[0].shape == (tokens, hidden)  # one mask, DoRA's too
    assert not any(t.dtype == torch.bool for t in redrawn)
    assert _distinct_bytes(kept) == _distinct_bytes(redrawn) + tokens * hidden


def _distinct_bytes(saved: list[torch.Tensor]) -> int:
    """The bytes of the distinct tensors among ``saved`` (DoRA's dropout term saves the layer's mask a second time)."""
    return sum(t.nbytes for t in {t.data_ptr(): t for t in saved}.values())
