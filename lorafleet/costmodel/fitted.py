"""Fitted source of a cost model: coefficients from a measured profile's records.

Every coefficient set comes out of the one non-negative relative fit in ``fit``: t(b, s)
per TP degree from the layer records (padded and packed alike, held-out ones excluded), the
head line per TP degree, the alpha-beta links from the timed transfers and all-reduces, the
optimizer line from the timed optimizer steps. Where the profile measured the forward alone
(``records.layer_forward``, ``records.head_forward``), its t_F(b, s) and head line are fitted the
same way, per TP degree that has both. Quality is k-fold cross-validation of t(b, s)
per TP degree (``layer_cv_tp<N>``) and over all degrees pooled (``layer_cv``), and of t_F pooled
(``forward_layer_cv``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from lorafleet.costmodel.fit import ErrorSummary, fit_affine, fit_layer_time, fit_link, kfold_layer_predictions
from lorafleet.costmodel.profile_format import (
    AffineJSON,
    Coefficients,
    HeadRecord,
    LayerRecord,
    LinkJSON,
    Profile,
    SizeRecord,
)
from lorafleet.costmodel.time_model import AffineTime, Link
from lorafleet.errors import InputError

ALLREDUCE_RANKS = 2


def _by_tp(records: tuple[LayerRecord, ...]) -> dict[int, list[LayerRecord]]:
    groups: dict[int, list[LayerRecord]] = defaultdict(list)
    for r in records:
        if not r.heldout:
            groups[r.tp].append(r)
    return dict(sorted(groups.items()))


def _heads(records: tuple[HeadRecord, ...]) -> dict[int, AffineJSON]:
    """The head line per TP degree: ms vs micro-batch tokens."""
    groups: dict[int, list[HeadRecord]] = defaultdict(list)
    for r in records:
        groups[r.tp].append(r)
    return {
        tp: AffineJSON.of(fit_affine([r.tokens for r in g], [r.time_ms for r in g])) for tp, g in sorted(groups.items())
    }


def _layers(records: tuple[LayerRecord, ...]) -> dict[int, tuple[float, ...]]:
    """t(b, s) per TP degree from the records that are not held out."""
    return {tp: fit_layer_time([r.shape for r in g], [r.time_ms for r in g]).c for tp, g in _by_tp(records).items()}


def _line(records: tuple[SizeRecord, ...]) -> AffineTime:
    return fit_affine([r.size for r in records], [r.time_ms for r in records]) if records else AffineTime()


def _link(records: tuple[SizeRecord, ...], allreduce: bool) -> Link:
    if not records:
        return Link()
    return fit_link([r.size for r in records], [r.time_ms for r in records], ALLREDUCE_RANKS, allreduce)


def layer_cv_quality(records: tuple[LayerRecord, ...], folds: int = 5, seed: int = 0) -> dict[str, ErrorSummary]:
    """k-fold CV relative errors of t(b, s), per TP degree and pooled (folds drawn within each degree)."""
    out: dict[str, ErrorSummary] = {}
    pooled_pred, pooled_meas = [], []
    for tp, group in _by_tp(records).items():
        if len(group) < 2:
            continue
        measured = np.array([r.time_ms for r in group])
        pred = kfold_layer_predictions([r.shape for r in group], measured, folds, seed)
        out[f"layer_cv_tp{tp}"] = ErrorSummary.of(pred, measured)
        pooled_pred.extend(pred)
        pooled_meas.extend(measured)
    if pooled_pred:
        out["layer_cv"] = ErrorSummary.of(pooled_pred, pooled_meas)
    return out


def fit_profile(profile: Profile, source: str = "<profile>", folds: int = 5) -> Profile:
    """``profile`` with ``coefficients`` fitted from its records and ``quality`` set to the CV summaries.

    Raises InputError (naming ``source``) when a TP degree of the memory table has no layer
    or head records to fit.
    """
    rec = profile.records
    layers, heads = _layers(rec.layer), _heads(rec.head)
    for tp in sorted({m.tp for m in profile.memory}):
        if tp not in layers:
            raise InputError(source, "records.layer", f"no (non-held-out) records for tp={tp}")
        if tp not in heads:
            raise InputError(source, "records.head", f"no records for tp={tp}")
    forward_layers, forward_heads = _layers(rec.layer_forward), _heads(rec.head_forward)
    forward_tps = set(forward_layers) & set(forward_heads)
    p2p = LinkJSON.of(_link(rec.p2p, allreduce=False))
    coefficients = Coefficients(
        layer_ms=layers,
        head_ms=heads,
        p2p_intra_node=p2p,
        p2p_inter_node=p2p,
        grad_sync=LinkJSON.of(_link(rec.allreduce, allreduce=True)),
        optimizer_ms=AffineJSON.of(_line(rec.optimizer)),
        forward_layer_ms={tp: c for tp, c in forward_layers.items() if tp in forward_tps},
        forward_head_ms={tp: a for tp, a in forward_heads.items() if tp in forward_tps},
    )
    quality = {name: s.to_json() for name, s in layer_cv_quality(rec.layer, folds).items()}
    forward_cv = layer_cv_quality(rec.layer_forward, folds).get("layer_cv")
    if forward_cv is not None:
        quality["forward_layer_cv"] = forward_cv.to_json()
    return profile.model_copy(update={"coefficients": coefficients, "quality": quality})
