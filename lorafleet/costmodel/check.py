"""Predicted vs measured on a profile's held-out records: what ``lorafleet costmodel check`` prints.

Held out are the layer records marked ``heldout`` (off-grid padded shapes and packed
micro-batches, never fitted), the same of the forward alone (``records.layer_forward``, kind
``forward``, against the fitted t_F(b, s)) and every replica record: whole measured steps over mixed
micro-batch lists, which the fit never sees and the cost model must compose from its parts
(blocks, head, gradient all-reduce, optimizer).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from lorafleet.costmodel.build import profile_cost_model
from lorafleet.costmodel.fit import ErrorSummary
from lorafleet.costmodel.profile_format import Profile
from lorafleet.costmodel.time_model import MS_PER_S
from lorafleet.specs.model import ModelSpec


@dataclass(frozen=True)
class Comparison:
    """One held-out record: what was measured and what the cost model predicts, ms."""

    kind: str
    """``layer`` (padded), ``packed``, ``forward`` (a block's forward alone, padded or packed) or ``replica``."""
    label: str
    measured_ms: float
    predicted_ms: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def _shape_label(mbs: int | None, seq_len: int | None, packed: tuple[int, ...] | None) -> str:
    return f"packed{list(packed)}" if packed is not None else f"{mbs}x{seq_len}"


def heldout_comparisons(profile: Profile, model: ModelSpec, source: str = "<profile>") -> list[Comparison]:
    """Every held-out record of ``profile`` next to the prediction of its own cost model, window-free: the profiler
    measures a stand-in of the model without its sliding windows (``profiling.replica``), so its records are compared
    with what the model would take with every layer global."""
    stand_in = model.model_copy(update={"sliding_window": 0, "layer_types": ()})
    cm = profile_cost_model(profile, stand_in, source=source)
    out = []
    for r in profile.records.layer:
        if r.heldout:
            kind = "packed" if r.packed is not None else "layer"
            label = f"tp{r.tp} {_shape_label(r.mbs, r.seq_len, r.packed)}"
            out.append(Comparison(kind, label, r.time_ms, cm.layer_time[r.tp].shape(r.shape)))
    for r in profile.records.layer_forward:
        if r.heldout and r.tp in cm.forward_layer_time:
            label = f"tp{r.tp} {_shape_label(r.mbs, r.seq_len, r.packed)}"
            out.append(Comparison("forward", label, r.time_ms, cm.forward_layer_time[r.tp].shape(r.shape)))
    for r in profile.records.replica:
        step = replace(cm, sync_replicas=r.sync_replicas)
        label = f"{r.config} sync={r.sync_replicas} " + " ".join(
            _shape_label(m.mbs, m.seq_len, m.packed) for m in r.microbatches
        )
        predicted = step.replica_time(r.config, [m.shape for m in r.microbatches]) * MS_PER_S
        out.append(Comparison("replica", label, r.time_ms, predicted))
    return out


def summarize(comparisons: list[Comparison]) -> dict[str, ErrorSummary]:
    """Relative-error summaries per kind and over all (``heldout_<kind>``, ``heldout``)."""
    groups: dict[str, list[Comparison]] = defaultdict(list)
    for c in comparisons:
        groups[f"heldout_{c.kind}"].append(c)
    if comparisons:
        groups["heldout"] = comparisons
    return {
        name: ErrorSummary.of([c.predicted_ms for c in group], [c.measured_ms for c in group])
        for name, group in sorted(groups.items())
    }
