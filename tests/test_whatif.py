"""What-if sweeps: points that cannot be built, and the plots (issue #17)."""

from __future__ import annotations

import csv

import pytest

from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.whatif import Variation, _point, sweep
from lorafleet.workload import load_workload
from tests.helpers.repo import EXAMPLES, SMALL_WORKLOAD


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    import yaml

    path = tmp_path_factory.mktemp("w") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL_WORKLOAD))
    return load_workload(path)


def test_a_point_that_does_not_fill_whole_nodes_is_skipped_with_a_note(small):
    notes: list[str] = []
    rows = sweep(small, [Variation.parse("gpus=12,8")], steps=1, on_skip=notes.append)
    assert notes == ["skipped gpus=12: 12 GPUs do not fill nodes of 8"]
    assert rows and {r["vary_gpus"] for r in rows} == {"8"}


def test_without_a_listener_a_skip_is_a_warning(small):
    with pytest.warns(UserWarning, match="skipped gpus=12: 12 GPUs do not fill nodes of 8"):
        rows = sweep(small, [Variation.parse("gpus=8,12")], steps=1)
    assert {r["vary_gpus"] for r in rows} == {"8"}


def test_a_sweep_with_no_valid_point_is_an_input_error(small):
    notes: list[str] = []
    with pytest.raises(InputError) as err:
        sweep(small, [Variation.parse("gpus=12,20")], steps=1, on_skip=notes.append)
    assert err.value.field == "--vary" and "gpus=12" in err.value.msg and "gpus=20" in err.value.msg
    assert notes == []  # nothing was planned, nothing skipped: the error says it all


def test_whatif_cli_skips_a_bad_point_and_keeps_the_others(tmp_path, capsys):
    argv = ["whatif", str(EXAMPLES / "lobra-7b.yaml"), "--vary", "gpus=10,16", "--steps", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "skipped" in line]
    assert notes == ["note: skipped gpus=10: 10 GPUs do not fill nodes of 8"]
    rows = list(csv.DictReader((tmp_path / "whatif.csv").open()))
    assert {r["vary_gpus"] for r in rows} == {"16"}


def test_whatif_cli_with_every_point_invalid_is_one_line(tmp_path, capsys):
    argv = ["whatif", str(EXAMPLES / "lobra-7b.yaml"), "--vary", "gpus=10,12", "--steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "wi")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and "<args>: --vary:" in err and "10 GPUs do not fill nodes of 8" in err
    assert "skipped" not in captured.out
    assert not (tmp_path / "wi" / "whatif.csv").exists()


def _rows(points: list[str], methods: list[str]) -> list[dict]:
    """Every bar about as tall as the tallest: no corner of the axes is free for a legend."""
    return [
        {
            "vary_gpus": p,
            "method": m,
            "gpu_s_per_step": 100.0 - 3 * j + i,
            "step_s": 10.0 - 0.3 * j + 0.1 * i,
        }
        for i, p in enumerate(points)
        for j, m in enumerate(methods)
    ]


@pytest.mark.parametrize("n_points", [1, 3, 8])
def test_the_whatif_legend_covers_no_bar(tmp_path, monkeypatch, n_points):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from lorafleet.commands.whatif import _plots

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    methods = ["lorafleet", "task-fused-padding", "task-fused-packing", "task-sequential"]
    written = _plots(_rows([str(8 * (k + 1)) for k in range(n_points)], methods), ["gpus"], tmp_path)
    assert [p.name for p in written] == ["gpu_s_per_step.png", "step_s.png"]
    assert len(figures) == 2
    for fig in figures:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        legend = ax.get_legend()
        box = legend.get_window_extent(renderer)
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(bars) == n_points * len(methods)
        for bar in bars:
            assert not box.overlaps(bar.get_window_extent(renderer)), (box, bar.get_window_extent(renderer))
        # ...and the legend is whole on the saved figure, not cut off at its edge.
        page = fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
        real_close(fig)


def test_a_pool_field_is_an_axis_and_nodes_0_leaves_the_pool_out(tmp_path):
    """#29: ``--vary pools.h100.nodes=0`` plans the a100 pool alone; another value edits the pool (the mixed
    fleet is planned as tests/planner/test_pools.py plans it); a pool or value that is not is one line."""
    from tests.helpers.pools import pools_fleet

    workload = pools_fleet(tmp_path)[0]
    rows = sweep(workload, [Variation.parse("pools.h100.nodes=0")], steps=1)
    ours = [r for r in rows if r["method"] == "lorafleet"]
    assert [(r["vary_pools.h100.nodes"], r["gpus_total"], r["gpu_kind"]) for r in ours] == [("0", 8, "A100-40GB")]
    varied, _ = _point(workload, {"pools.h100.nodes": "1", "pools.a100.price_per_gpu_hour": "2"})
    assert [(p.name, p.nodes, p.price_per_gpu_hour) for p in varied.cluster.pools] == [
        ("a100", 1, 2.0),
        ("h100", 1, 2.5),
    ]
    with pytest.raises(InputError, match="--vary: pools.b200.nodes: the cluster has no pool 'b200' .a100, h100."):
        sweep(workload, [Variation.parse("pools.b200.nodes=1")], steps=1)
    with pytest.raises(InputError, match="pools.h100.price_per_gpu_hour=-1: Input should be greater than or equal"):
        sweep(workload, [Variation.parse("pools.h100.price_per_gpu_hour=-1")], steps=1)
    with pytest.raises(InputError, match="or pools.NAME.KEY"):
        Variation.parse("pools.h100.name=x")
