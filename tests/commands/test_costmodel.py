"""``lorafleet costmodel predict|check`` and ``lorafleet fit``, through the CLI entry point."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from lorafleet.cli import main
from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.build import analytic_profile
from lorafleet.costmodel.profile_format import (
    HeadRecord,
    LayerRecord,
    Records,
    ReplicaRecord,
    ShapeJSON,
    read_profile,
    write_profile,
)
from lorafleet.costmodel.time_model import LayerTimeCoeffs, MicroBatchShape
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.model import MODEL_PRESETS
from tests.helpers.lobra_data import LAYER_TIME_CSV

TINY = MODEL_PRESETS["tiny-llama"]
TRUE = LayerTimeCoeffs((2e-6, 0.0, 0.02, 0.0, 0.1, 3.0))


def _measured_profile(tmp_path):
    """A synthetic 'measured' profile whose records follow TRUE exactly (what `lorafleet profile` would write)."""
    base = analytic_profile(TINY, ClusterSpec(gpu="cpu", nodes=1, gpus_per_node=2), AdapterLoad.uniform(3, 8))
    grid = [MicroBatchShape.padded(b, s) for s in (16, 64, 256, 1024) for b in (1, 2, 4)]
    held = [MicroBatchShape.padded(3, 300), MicroBatchShape.packed([100, 400])]
    layer = [
        LayerRecord(**ShapeJSON.of(mb).model_dump(), tp=tp, time_ms=TRUE.shape(mb)) for tp in (1, 2) for mb in grid
    ]
    layer += [LayerRecord(**ShapeJSON.of(mb).model_dump(), tp=1, time_ms=TRUE.shape(mb), heldout=True) for mb in held]
    head = [HeadRecord(tp=tp, tokens=n, time_ms=0.5 + 0.01 * n) for tp in (1, 2) for n in (16, 256, 4096)]
    replica = [ReplicaRecord(tp=1, microbatches=(ShapeJSON(mbs=2, seq_len=64),), time_ms=4 * TRUE(2, 64) + 0.5 + 1.28)]
    profile = base.model_copy(
        update={
            "kind": "measured",
            "coefficients": None,
            "records": Records(layer=tuple(layer), head=tuple(head), replica=tuple(replica)),
        }
    )
    path = tmp_path / "tiny.json"
    write_profile(profile, path)
    return path


def test_predict_one_micro_batch_analytic(capsys):
    assert (
        main(
            [
                "costmodel",
                "predict",
                "--model",
                "llama2-7b",
                "--gpu",
                "A100-40GB",
                "--tp",
                "2",
                "--seq-len",
                "2048",
                "--mbs",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "analytic:A100-40GB" in out and "max tokens M" in out and "per-layer time" in out and "replica step" in out


def test_predict_with_recompute_holds_what_the_plain_config_cannot(capsys):
    argv = [
        "costmodel",
        "predict",
        "--model",
        "llama2-70b",
        "--gpu",
        "A800-80GB",
        "--tp",
        "4",
        "--seq-len",
        "16384",
        "--mbs",
        "1",
    ]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--recompute"]) == 0
    rc = capsys.readouterr().out
    assert "<4,1>" in plain and "exceeds M" in plain
    assert "<4,1,rc>" in rc and "fits" in rc and "recomputed" in rc


def test_predict_csv_adds_pred_ms(reference_dir, tmp_path, capsys):
    out_path = tmp_path / "pred.csv"
    assert (
        main(
            [
                "costmodel",
                "predict",
                "--model",
                "llama2-7b",
                "--csv",
                str(reference_dir / LAYER_TIME_CSV),
                "--out",
                str(out_path),
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(out_path.open()))
    assert len(rows) == 223 and {"pred_ms", "stage_ms", "max_tokens", "time"} <= set(rows[0])
    assert "median=" in capsys.readouterr().err  # pred_ms vs the CSV's measured time


def test_predict_from_a_profile_to_stdout(tmp_path, capsys):
    path = _measured_profile(tmp_path)
    csv_in = tmp_path / "q.csv"
    csv_in.write_text("tp,seq_len,mbs\n1,300,3\n2,64,1\n")
    assert main(["costmodel", "predict", "--profile", str(path), "--model", "tiny-llama", "--csv", str(csv_in)]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert float(rows[0]["pred_ms"]) == pytest.approx(TRUE(3, 300), rel=1e-3)


def test_fit_then_check(tmp_path, capsys):
    path = _measured_profile(tmp_path)
    assert main(["fit", str(path)]) == 0
    fitted = read_profile(path)
    assert fitted.coefficients is not None and fitted.quality["layer_cv"]["median"] < 1e-3
    assert fitted.quality["heldout_packed"]["median"] < 1e-3
    capsys.readouterr()
    assert main(["costmodel", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "heldout_layer" in out and "heldout_replica" in out and "p90=" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["costmodel", "predict", "--model", "nope", "--tp", "1", "--seq-len", "8", "--mbs", "1"], "unknown model"),
        (
            [
                "costmodel",
                "predict",
                "--model",
                "llama2-7b",
                "--gpu",
                "TPU",
                "--tp",
                "1",
                "--seq-len",
                "8",
                "--mbs",
                "1",
            ],
            "--gpu",
        ),
        (["costmodel", "predict", "--model", "llama2-7b", "--tp", "3", "--seq-len", "8", "--mbs", "1"], "no tp=3"),
        (["costmodel", "predict", "--model", "llama2-7b", "--tp", "1"], "--seq-len"),
        (
            [
                "costmodel",
                "predict",
                "--profile",
                "missing.json",
                "--model",
                "llama2-7b",
                "--tp",
                "1",
                "--seq-len",
                "8",
                "--mbs",
                "1",
            ],
            "no such file",
        ),
        (["costmodel", "check", "profiles/llama2-7b-a100-40gb-analytic.json"], "no held-out records"),
        (["profile", "--model", "tiny-llama", "--configs", "3x1", "--out", "x.json"], "--configs"),
        (["profile", "--model", "tiny-llama", "--configs", "1x1", "--out", "x.json", "--mbs", "0"], "--mbs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the repository root: profiles/ is relative
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
