"""The load model's tables are its formulas to the bit, however they are evaluated."""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.dispatch.load import _row_cost


@pytest.mark.parametrize(
    "shape_coeffs, shape_n",
    [((), (40,)), ((40,), (40,)), ((3, 40), (40,)), ((3, 1), (3, 40)), ((40,), (5, 40))],
)
def test_row_cost_is_its_expression_bit_for_bit(shape_coeffs, shape_n):
    """alpha n + beta ceil(n / b) and the largest micro-batch alpha min(n, b) + beta (0 for n = 0), for the shapes
    the balancers and the tables pass (one class or several, one count per bucket or many)."""
    rng = np.random.default_rng(7)
    alpha, beta = rng.random(shape_coeffs) / 3, rng.random(shape_coeffs) * 7
    b = rng.integers(1, 40, shape_coeffs)
    n = rng.integers(0, 200, shape_n)
    n.flat[::5] = 0
    compute, largest = _row_cost(alpha, beta, b, n)
    x = n.astype(float)
    assert compute.tobytes() == (alpha * x + beta * np.ceil(x / b)).tobytes()
    assert largest.tobytes() == np.where(x > 0, alpha * np.minimum(x, b) + beta, 0.0).tobytes()
