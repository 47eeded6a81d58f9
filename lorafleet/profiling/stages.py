"""Which part of an executor replica a timed run covers: a role and a layer subset for ``stage_forward``.

The executor's ``step.stage_forward(model, role, x, inputs)`` runs the decoder layers the
model holds (``model.model.layers``, a ``ModuleDict`` after ``split_for_pipeline``), starts
at the token embedding only on a first stage and ends in the final norm and LM head only on
a last one. The profiler times parts of one replica through that same function:

- the block stack alone: a *middle* stage (neither first nor last) over all L layers;
- the head alone: a last, not first, stage over no layer;
- a pipeline stage of ⟨tp, pp⟩ (memory): the stage's own role and layers.

So every timed part runs exactly the executor's forward, not a replica of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from lorafleet.runtime.layout import RankRole, ReplicaLayout


def role_in(layout: ReplicaLayout, stage: int, tp_rank: int) -> RankRole:
    """The role of TP rank ``tp_rank`` of ``stage`` in a replica laid out on ranks 0..tp*pp-1."""
    return RankRole(layout.stage_ranks(stage)[tp_rank], layout, stage, tp_rank)


def stage_layout(tp: int, pp: int, n_layers: int, recompute: bool = False) -> ReplicaLayout:
    """One replica of ⟨tp, pp⟩ on ranks 0..tp*pp-1 (the profiler emulates its stages one at a time)."""
    return ReplicaLayout(0, tp, pp, tuple(range(tp * pp)), n_layers, recompute)


def part_role(tp: int, tp_rank: int, *, embeds: bool, heads: bool) -> RankRole:
    """A role whose ``stage_forward`` starts at the embedding iff ``embeds`` and ends in the head iff
    ``heads``: the middle stage of three, an end stage of two, or the whole model of one.

    Which layers it runs is the model's business (:func:`only_layers`), not the role's.
    """
    pp = 3 - embeds - heads
    stage = 0 if embeds else pp - 1 if heads else 1
    return role_in(stage_layout(tp, pp, pp), stage, tp_rank)


@contextmanager
def only_layers(model: nn.Module, layers: Iterable[int]) -> Iterator[None]:
    """Within the block, the model holds only decoder layers ``layers`` (a stage's share of a
    replica built with every layer); the full set is restored on exit."""
    inner = model.model
    full = inner.layers
    inner.layers = nn.ModuleDict({str(i): full[str(i)] for i in layers})
    try:
        yield
    finally:
        inner.layers = full
