"""One multi-LoRA layer with dropout, run with its keep-mask drawn again in the backward (``dropout.MaskReplay``, as
shipped) and with the forward's own mask kept for the backward (the operator before the replay): shared by
``test_dropout_replay.py`` (torch backend) and ``kernels/interpreted_mask_replay.py`` (Triton, interpreted)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lorafleet.executor.torch import multi_lora
from lorafleet.executor.torch.dropout import MaskReplay, draw_keep_mask
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.routing import LoraBackend, Segments
from lorafleet.executor.torch.token_split import TokenSplit
from lorafleet.specs.lora import LoraSpec

K, N = 24, 20
SPECS = (
    LoraSpec(rank=4, alpha=8, dropout=0.3),
    LoraSpec(rank=4, alpha=8, dropout=0.2, use_dora=True),
    LoraSpec(rank=2, alpha=4, dropout=0.1, use_rslora=True),
    LoraSpec(rank=4, alpha=8),
)
"""LoRA, DoRA and rsLoRA with dropout, and one adapter without (its rows of the mask are all True)."""
SEGMENTS = Segments.packed([0, 1, 2, 3, 1, 0], [5, 6, 4, 3, 2, 3])
ROWS = 23
SEED = 7


def layer(backend: LoraBackend, split: TokenSplit | None = None) -> MultiLoraLinear:
    """The layer of :data:`SPECS` on :data:`SEGMENTS`, its factors moved off their start (``B != 0``, ``m`` not
    ``||W||_c``) so every gradient depends on the mask; with ``split`` a column-parallel TP rank's (its rows of the
    input saved, ``token_split.py``)."""
    torch.manual_seed(3)  # the base layer's init
    gen = torch.Generator().manual_seed(3)
    out = MultiLoraLinear(nn.Linear(K, N), backend=backend).train()
    for a, spec in enumerate(SPECS):
        A = torch.randn(spec.rank, K, generator=gen) * 0.3
        out.add_adapter(a, spec, (A, torch.randn(N, spec.rank, generator=gen) * 0.3))
    with torch.no_grad():
        out.lora_magnitude_vector["1"].mul_(1.3)
    out.segments = SEGMENTS
    out.token_split = split
    return out


def rank_rows_alone(self: TokenSplit, buffer: torch.Tensor, total: int) -> torch.Tensor:
    """``TokenSplit.reduce`` without a process group: this rank's rows of its own ``dS'`` (the other rank's
    partial left out), so one process plays a TP rank's backward: its ``dA`` from its rows of ``X`` and ``M``."""
    first, end = self.bounds(total)
    return buffer[first:end]


def gradients(net: MultiLoraLinear, recompute: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Output, input gradient and every factor's gradient of one step (as :data:`SEED` sets the global generator),
    and the global generator's state when the forward returned."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, K, generator=gen).requires_grad_()
    grad_y = torch.randn(ROWS, N, generator=gen)
    net.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    y = checkpoint(net, x, use_reentrant=False) if recompute else net(x)
    state = torch.get_rng_state()
    y.backward(grad_y)
    out = {"y": y.detach(), "x": x.grad}
    out.update({name: p.grad for name, p in net.named_parameters() if p.requires_grad})
    return out, state


@contextmanager
def masks_kept(monkeypatch) -> Iterator[dict[MaskReplay, torch.Tensor]]:
    """The operator before the replay: each backward gets the very mask its forward drew, kept from the forward
    (``MaskReplay.mask`` hands it back instead of drawing). Yields the masks by replay."""
    drawn: dict[MaskReplay, torch.Tensor] = {}
    pending: list[MaskReplay] = []
    next_draw = MaskReplay.next_draw

    def noting(cls, *args) -> MaskReplay | None:
        replay = next_draw(*args)
        if replay is not None:
            pending.append(replay)
        return replay

    def drawing(*args, **kwargs) -> torch.Tensor | None:
        keep = draw_keep_mask(*args, **kwargs)
        drawn[pending.pop()] = keep
        return keep

    monkeypatch.setattr(MaskReplay, "next_draw", classmethod(noting))
    monkeypatch.setattr(multi_lora, "draw_keep_mask", drawing)
    monkeypatch.setattr(MaskReplay, "mask", lambda self: drawn[self])
    yield drawn
    monkeypatch.undo()


def perturbed_mask(self: MaskReplay) -> torch.Tensor:
    """A replay gone wrong: drawn from its state moved on by one random word."""
    generator = torch.Generator()
    generator.set_state(self.state)
    torch.empty(1, dtype=torch.int64).random_(generator=generator)
    return draw_keep_mask(self.rows, self.cols, self.routing, device=self.device, generator=generator)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``got`` equal to ``want``'s bit for bit, and the same names."""
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def differs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> set[str]:
    """The names whose tensors differ."""
    return {name for name, tensor in want.items() if not torch.equal(got[name], tensor)}


def replay_against_kept(backend: LoraBackend, recompute: bool, monkeypatch, split: TokenSplit | None = None) -> None:
    """The gradients, output and after-forward generator state with the mask drawn again equal those with the
    forward's mask kept, bit for bit; the kept masks drop something on every dropping adapter's rows. With
    ``split``, as that TP rank's backward (:func:`rank_rows_alone`): ``dX`` reads the whole mask, ``dA`` its rows."""
    with masks_kept(monkeypatch) as drawn:
        if split is not None:
            monkeypatch.setattr(TokenSplit, "reduce", rank_rows_alone)
        want, want_state = gradients(layer(backend, split), recompute)
    keep = next(iter(drawn.values()))
    assert not keep[:5].all() and not keep[5:11].all() and keep[15:18].all()  # LoRA and DoRA drop, p = 0 keeps
    if split is not None:
        monkeypatch.setattr(TokenSplit, "reduce", rank_rows_alone)
    got, got_state = gradients(layer(backend, split), recompute)
    monkeypatch.undo()
    assert_bitwise_equal(got, want)
    assert torch.equal(got_state, want_state)


def perturbed_replay_is_caught(backend: LoraBackend, monkeypatch) -> set[str]:
    """The gradients that differ from the kept masks' when the replay draws from a perturbed state."""
    with masks_kept(monkeypatch):
        want, _ = gradients(layer(backend))
    monkeypatch.setattr(MaskReplay, "mask", perturbed_mask)
    got, _ = gradients(layer(backend))
    monkeypatch.undo()
    return differs(got, want)
