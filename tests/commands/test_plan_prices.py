"""Pool prices at their edges (#38): a price of 0 is a pool already owned, and ``plan --objective cost`` plans on
it (a cost of 0, the cheapest-plan logic never divides by a price); a price too large for a step's cost to be a
finite number is refused where it is read, one line naming the field."""

from __future__ import annotations

import math

import pytest
import yaml

from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.planner import PlannerOptions
from tests.helpers.pools import POOLS_WORKLOAD


def _write(tmp_path, *prices: float):
    pools = [{**pool, "price_per_gpu_hour": price} for pool, price in zip(POOLS_WORKLOAD["cluster"]["pools"], prices)]
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump({**POOLS_WORKLOAD, "cluster": {"pools": pools}}))
    return str(path)


@pytest.mark.parametrize("prices", [(0.0, 0.0), (0.0, 2.5)], ids=["every-pool-free", "one-pool-free"])
def test_a_zero_price_plans_by_cost(tmp_path, capsys, prices):
    """Every pool (or one) at 0 a GPU-hour: the plan costs what its priced replicas cost, the comparison
    table prints without dividing by a baseline's cost of 0, and the printed costs are finite numbers."""
    assert main(["plan", _write(tmp_path, *prices), "--objective", "cost", "--samples", "0"]) == 0
    out = capsys.readouterr().out
    assert "inf" not in out and "nan" not in out
    cost = next(line for line in out.splitlines() if "a step at the pools' prices" in line)
    assert math.isfinite(float(cost.split()[1]))
    if prices == (0.0, 0.0):
        assert cost.split()[1] == "0"


def test_a_zero_price_sizes_by_cost(tmp_path, capsys):
    """``--gpus auto`` over pools that cost nothing: every mix's step costs 0, and the tie goes to fewer GPUs."""
    args = ["plan", _write(tmp_path, 0.0, 0.0), "--gpus", "auto", "--max-nodes", "1", "--samples", "0"]
    assert main([*args, "--objective", "cost"]) == 0
    out = capsys.readouterr().out
    assert "chosen: 4 GPUs, cheapest of 3 feasible counts at the pools' prices (0 a step" in out


@pytest.mark.parametrize("price", [1e308, 1e12])
def test_an_absurd_price_is_one_line_naming_the_field(tmp_path, capsys, price):
    assert main(["plan", _write(tmp_path, price, 2.5), "--objective", "cost"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cluster.pools[0].price_per_gpu_hour:" in err and "at most" in err
    with pytest.raises(InputError, match="prices"):
        PlannerOptions(prices=(("a100", price),))
