"""The adapter-dropout keep-mask drawn again in the backward on a GPU (``dropout.MaskReplay``): CUDA's Philox
generator, which the CPU tests (``tests/executor/torch/test_dropout_replay.py``) cannot reach. The replay gives the
forward's mask bit for bit and moves neither the global generator's state when recorded nor when drawn; a layer's
gradients with the mask drawn again equal those with the forward's mask kept."""

from __future__ import annotations

import pytest
import torch

from lorafleet.executor.torch.dropout import MaskReplay, draw_keep_mask
from lorafleet.executor.torch.routing import LoraRouting, Segments

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU twin: tests/executor/torch/test_dropout_replay.py)"
)

CUDA = torch.device("cuda")
ROUTING = LoraRouting(Segments.packed([0, 1, 0, 2], [300, 40, 700, 90]), (2.0, 1.0, 0.5), (0.1, 0.0, 0.25))


@pytest.mark.parametrize("cols", [33, 4096])
def test_the_replay_draws_the_forwards_mask_on_cuda(cols):
    torch.cuda.manual_seed(5)
    plain = draw_keep_mask(1130, cols, ROUTING, device=CUDA)
    after_plain = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(5)
    before = torch.cuda.get_rng_state()
    replay = MaskReplay.next_draw(1130, cols, ROUTING, CUDA)
    assert replay is not None and torch.equal(torch.cuda.get_rng_state(), before)
    keep = draw_keep_mask(1130, cols, ROUTING, device=CUDA)
    assert torch.equal(keep, plain) and torch.equal(torch.cuda.get_rng_state(), after_plain)
    assert torch.equal(replay.mask(), keep) and torch.equal(torch.cuda.get_rng_state(), after_plain)
    assert not keep[:300].all() and keep[300:340].all()
