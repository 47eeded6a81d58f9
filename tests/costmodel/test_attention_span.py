"""Sliding windows in the cost model: the key positions a windowed block meets, and where they are priced."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lorafleet.costmodel.attention_span import AttentionSpan, stage_span
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import LayerTimeCoeffs, MicroBatchShape
from lorafleet.presets import lobra_7b_cost_model
from lorafleet.specs.architecture import attention_layout
from lorafleet.specs.model import MODEL_PRESETS, ModelSpec

COEFFS = (1.3e-7, 2e-8, 4.6e-3, 8e-4, 3e-2, 2.4)


def key_positions(s: int, w: int | None) -> int:
    """The (query, key) pairs a causal mask within a window of w keys lets through, counted on the mask itself."""
    i, j = np.indices((s, s))
    allowed = (j <= i) & ((i - j < w) if w is not None else True)
    return int(allowed.sum())


@pytest.mark.parametrize(("s", "w", "share"), [(1, 4, 1.0), (7, 7, 1.0), (9, 4, 1.0), (300, 64, 5 / 6), (50, 8, 0.5)])
def test_ratio_is_the_masks_key_positions_over_causal(s: int, w: int, share: float) -> None:
    expected = (1 - share) + share * key_positions(s, w) / key_positions(s, None)
    assert AttentionSpan(w, share).ratio(np.array([s]))[0] == pytest.approx(expected, rel=1e-12)


def test_sequences_within_the_window_cost_what_global_attention_costs_bit_for_bit() -> None:
    plain, windowed = LayerTimeCoeffs(COEFFS), LayerTimeCoeffs(COEFFS, AttentionSpan(4096, 5 / 6))
    mbs = [MicroBatchShape.packed([4096, 17, 900]), MicroBatchShape.padded(3, 2048)]
    assert np.array_equal(windowed.shapes(mbs), plain.shapes(mbs))
    assert windowed(3, 2048) == plain(3, 2048)


def test_longer_sequences_pay_the_window_in_every_form_and_the_floor_stays_below() -> None:
    span = AttentionSpan(512, 5 / 6)
    plain, windowed = LayerTimeCoeffs(COEFFS), LayerTimeCoeffs(COEFFS, span)
    c1 = COEFFS[0]
    saved = c1 * 8192**2 * (1 - span.ratio(np.array([8192]))[0])
    assert plain.shape(MicroBatchShape.packed([8192])) - windowed.shape(MicroBatchShape.packed([8192])) == (
        pytest.approx(saved, rel=1e-9)
    )
    assert windowed(2, 8192) == pytest.approx(windowed.shape(MicroBatchShape.padded(2, 8192)), rel=1e-12)
    for derived in (windowed.extended(13, 1e-3, 0.5), windowed.recomputed(), windowed.forward()):
        assert derived.span == span
    lengths = np.array([1, 511, 512, 513, 4000, 8192])
    floor = windowed.global_floor()
    assert floor.span is None
    assert all(floor.packed([n]) <= windowed.packed([n]) for n in lengths)


def test_the_busiest_stage_holds_the_fewest_windowed_layers() -> None:
    assert stage_span(MODEL_PRESETS["llama2-7b"], 1) is None
    assert stage_span(MODEL_PRESETS["mistral-7b"], 4) == AttentionSpan(4096, 1.0)
    assert stage_span(MODEL_PRESETS["gemma3-1b"], 1) == AttentionSpan(512, 22 / 26)  # layers 5, 11, 17, 23 global
    assert stage_span(MODEL_PRESETS["gemma2-2b"], 2) == AttentionSpan(4096, 6 / 13)  # layer 0 windowed: 7 + 6


def test_the_cost_model_prices_each_stage_and_block_over_its_models_windows() -> None:
    """A model without windows: no span anywhere (LobRA's form, bit for bit); Gemma 3's coefficients (here the 7B
    preset's numbers) over its 5 : 1 layers, in the stage, the block and the forward alone."""
    cm = lobra_7b_cost_model()
    for config in (ParallelConfig(1), ParallelConfig(2, 2)):
        assert cm.stage_coeffs(config).span is None and cm.block_coeffs(config).span is None
    gemma = replace(cm, model=MODEL_PRESETS["gemma3-1b"])
    span = AttentionSpan(512, 22 / 26)
    for config in (ParallelConfig(1), ParallelConfig(2, 2)):
        spans = (
            gemma.stage_coeffs(config).span,
            gemma.block_coeffs(config).span,
            gemma.forward_stage_coeffs(config).span,
        )
        assert spans == (span, span, span)


def test_config_json_fields_give_the_layouts_transformers_derives() -> None:
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096, "max_window_layers": 2}
    assert attention_layout(qwen) == (None, ("full_attention",) * 4)
    assert (
        attention_layout({**qwen, "use_sliding_window": True})[1]
        == ("full_attention",) * 2 + ("sliding_attention",) * 2
    )
    assert attention_layout({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 4096}) == (4096, ())
    # transformers 5.25's Gemma3TextConfig(num_hidden_layers=7).layer_types and Gemma2Config's, by type
    gemma3 = {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 512}
    s, f = "sliding_attention", "full_attention"
    assert attention_layout(gemma3) == (512, (s, s, s, s, s, f, s))
    assert attention_layout({**gemma3, "model_type": "gemma2"})[1] == (s, f, s, f, s, f, s)


def test_layer_types_of_another_length_or_kind_are_refused() -> None:
    dims = {"name": "m", "n_layers": 2, "hidden": 8, "ffn": 16, "n_heads": 2, "n_kv_heads": 2, "vocab": 10}
    with pytest.raises(ValueError, match="names 1 layers, the model has 2"):
        ModelSpec(**dims, sliding_window=4, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="local"):
        ModelSpec(**dims, sliding_window=4, layer_types=("local", "full_attention"))


def test_the_dispatchers_least_time_of_a_sequence_stays_below_its_windowed_time() -> None:
    """``sequence_lower_bound`` (LobRA's plain form) takes c1 (1 - f): a sequence alone in a micro-batch of its own
    length costs at least it, where the window-free c1 would overstate the time past the window."""
    from lorafleet.dispatch import sequence_lower_bound

    gemma = replace(lobra_7b_cost_model(), model=MODEL_PRESETS["gemma3-1b"])
    config = ParallelConfig(1)
    for n in (256, 512, 4096, 8192):
        bound = float(sequence_lower_bound(gemma, config, n, np.array([n]))[0])
        assert bound <= gemma.packed_microbatch_time(config, [n])
    assert gemma.stage_coeffs(config).windowed(None).packed([8192]) / 1e3 > gemma.packed_microbatch_time(config, [8192])
