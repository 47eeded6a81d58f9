"""LobRA's t(b, s), its packed form, and the affine and link terms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lorafleet.costmodel.attention_span import AttentionSpan
from lorafleet.costmodel.time_model import (
    AffineTime,
    LaidOutShapes,
    LayerTimeCoeffs,
    Link,
    MicroBatchShape,
    features_of,
    shape_features,
)

COEFFS = LayerTimeCoeffs((1e-7, 2e-8, 4e-3, 8e-4, 3e-2, 2.5))


def test_t_matches_lobra_equation_and_vectorises():
    b = np.array([1, 4, 16])
    s = np.array([128, 2048, 512])
    c1, c2, c3, c4, c5, c6 = COEFFS.c
    expected = (c1 * b + c2) * s**2 + (c3 * b + c4) * s + (c5 * b + c6)
    np.testing.assert_allclose(COEFFS(b, s), expected)
    assert isinstance(COEFFS(4, 2048), float) and COEFFS(4, 2048) == pytest.approx(expected[1])


def test_t_is_its_formula_to_the_bit_over_every_shape():
    """``t(b, s)``, its sums added in place, is ``(c1 b + c2) s^2 + (c3 b + c4) s + (c5 b + c6)`` written as one
    expression, bit for bit: scalars, a scalar b over lengths (a load model's), b (2, 1) against lengths (the
    packer's α, β), arrays of both, with and without sliding windows (c1 a per-length array)."""
    rng = np.random.default_rng(5)
    s = rng.integers(1, 9000, 300)
    for coeffs in (COEFFS, LayerTimeCoeffs(COEFFS.c, AttentionSpan(1024, 5 / 6))):
        for b, lengths in ((3, 700), (2, s), (np.array([[1], [2]]), s), (rng.integers(0, 9, 300), s)):
            c1, c2, c3, c4, c5, c6 = coeffs.c
            bf, sf = np.asarray(b, dtype=float), np.asarray(lengths, dtype=float)
            if coeffs.span is not None:
                c1 = c1 * coeffs.span.ratio(sf)
            formula = np.where(bf > 0, (c1 * bf + c2) * sf**2 + (c3 * bf + c4) * sf + (c5 * bf + c6), 0.0)
            assert np.array_equal(np.asarray(coeffs(b, lengths)), formula)


def test_empty_fragment_is_free():
    assert COEFFS(0, 4096) == 0.0
    np.testing.assert_array_equal(COEFFS(np.array([0, 1]), 512)[:1], [0.0])


def test_one_row_count_over_many_lengths_is_each_alone():
    """A scalar b over an array of lengths (a load model's rows) gives each length's time to the bit, 0 for b = 0."""
    s = np.array([1, 128, 2048, 4095, 16384])
    for b in (1, 2, 7):
        assert COEFFS(b, s).tolist() == [COEFFS(b, int(x)) for x in s]
    np.testing.assert_array_equal(COEFFS(0, s), np.zeros(s.size))


@given(b=st.integers(1, 32), s=st.integers(1, 16384))
def test_packed_without_padding_costs_the_padded_time(b, s):
    assert COEFFS.packed([s] * b) == pytest.approx(COEFFS(b, s))
    assert COEFFS.shape(MicroBatchShape.padded(b, s)) == pytest.approx(COEFFS(b, s))


@given(lens=st.lists(st.integers(1, 4096), min_size=1, max_size=16))
def test_packing_never_costs_more_than_padding(lens):
    padded = MicroBatchShape(tuple(lens), max(lens))
    assert COEFFS.packed(lens) <= COEFFS.shape(padded) * (1 + 1e-12)


def test_packed_terms_attention_per_sequence_linear_in_tokens():
    lens = [100, 300, 600]
    x = shape_features(MicroBatchShape.packed(lens))
    np.testing.assert_allclose(x, [100**2 + 300**2 + 600**2, 600**2, 1000, 600, 3, 1])


def test_extended_adds_affine_terms_in_lobra_form():
    stage = COEFFS.extended(8, per_token=0.01, fixed=1.5)
    b, s = 4, 1024
    assert stage(b, s) == pytest.approx(8 * COEFFS(b, s) + 0.01 * b * s + 1.5)
    assert stage.packed([300, 700]) == pytest.approx(8 * COEFFS.packed([300, 700]) + 0.01 * 1000 + 1.5)


def test_micro_batch_tokens():
    assert MicroBatchShape((100, 250), 256).tokens == 512
    assert MicroBatchShape.packed([100, 250]).tokens == 350


def test_affine_time():
    line = AffineTime(2.0, 0.5)
    assert line(10) == 7.0 and line(0) == 0.0
    np.testing.assert_allclose(line(np.array([0, 2])), [0.0, 3.0])


def test_link_alpha_beta_and_ring_allreduce():
    link = Link(latency_ms=0.01, gb_per_s=100.0)
    n = 1e9
    assert link.transfer().__call__(n) == pytest.approx(0.01 + 10.0)  # 1 GB at 100 GB/s is 10 ms
    # ring over 4 ranks: 6 steps of n/4 bytes
    assert link.allreduce(4)(n) == pytest.approx(6 * 0.01 + 6 / 4 * 10.0)
    assert link.allreduce(1)(n) == 0.0
    assert Link().transfer()(n) == 0.0


def test_features_of_many_is_each_one_alone():
    """The one-pass features of a mixed list (padded, packed, empty between them) are those of
    each micro-batch alone, and a padded (b, s) is [b s^2, s^2, b s, s, b, 1]."""
    mbs = [
        MicroBatchShape.padded(3, 7),
        MicroBatchShape((), None),
        MicroBatchShape.packed([5, 2, 9]),
        MicroBatchShape((), 4),
        MicroBatchShape.packed([1]),
    ]
    many = features_of(mbs)
    assert many.shape == (5, 6)
    assert np.array_equal(many[0], [3 * 49, 49, 21, 7, 3, 1]) and not many[1].any() and not many[3].any()
    assert np.array_equal(many[2], [25 + 4 + 81, 81, 16, 9, 3, 1]) and np.array_equal(many[4], [1, 1, 1, 1, 1, 1])
    for mb, row in zip(mbs, many, strict=True):
        assert np.array_equal(features_of([mb])[0], row)
    coeffs = LayerTimeCoeffs((1e-3, 2e-3, 0.1, 0.2, 0.5, 3.0))
    assert np.allclose(coeffs.shapes(mbs), [coeffs.shape(mb) for mb in mbs])
    assert features_of([]).shape == (0, 6) and not features_of([mbs[1], mbs[3]]).any()  # nothing held: zeros


def test_features_of_packed_only_is_each_one_alone():
    """A list of packed micro-batches only (the packer's, read through one chain of their lengths), with and
    without an empty one among them, gives each micro-batch's features alone, to the bit."""
    rng = np.random.default_rng(3)
    packed = [MicroBatchShape.packed(rng.integers(1, 5000, int(n)).tolist()) for n in rng.integers(1, 40, 30)]
    for mbs in (packed, [*packed[:7], MicroBatchShape((), None), *packed[7:]]):
        many = features_of(mbs)
        assert many.shape == (len(mbs), 6)
        for mb, row in zip(mbs, many, strict=True):
            assert np.array_equal(features_of([mb])[0], row)


def test_laid_out_shapes_price_as_the_list_they_are():
    """Micro-batches that bring their rows' lengths and counts along (``LaidOutShapes``, the packer's) get the
    features of the same list read one micro-batch at a time, to the bit; rows that do not add up are refused."""
    rng = np.random.default_rng(4)
    mbs = [MicroBatchShape.packed(rng.integers(1, 5000, int(n)).tolist()) for n in rng.integers(1, 40, 30)]
    lengths = np.array([s for mb in mbs for s in mb.seq_lens], dtype=float)
    counts = np.array([mb.n_seqs for mb in mbs], dtype=np.int64)
    laid_out = LaidOutShapes(mbs, lengths, counts)
    assert laid_out == mbs and np.array_equal(features_of(laid_out), features_of(mbs))
    with pytest.raises(ValueError, match="30 shapes, 29 row counts"):
        LaidOutShapes(mbs, lengths, counts[1:])
