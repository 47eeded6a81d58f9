"""Profile files: versioned, validated on read with errors naming file and field, written deterministically."""

from __future__ import annotations

import json

import pytest

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.build import analytic_profile, profile_cost_model
from lorafleet.costmodel.fitted import fit_profile
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.profile_format import (
    HeadRecord,
    LayerRecord,
    Profile,
    Records,
    ReplicaRecord,
    ShapeJSON,
    read_layer_csv,
    read_profile,
    write_profile,
)
from lorafleet.costmodel.time_model import LayerTimeCoeffs, MicroBatchShape
from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.model import MODEL_PRESETS

PROFILE = analytic_profile(
    MODEL_PRESETS["tiny-llama"], ClusterSpec(gpu="cpu", nodes=1, gpus_per_node=2), AdapterLoad.uniform(3, 8)
)
RECORDS = Records(
    layer=(
        LayerRecord(tp=1, mbs=2, seq_len=64, time_ms=3.5),
        LayerRecord(tp=1, packed=(30, 70), time_ms=2.5, heldout=True),
    ),
    replica=(ReplicaRecord(tp=1, microbatches=(ShapeJSON(mbs=1, seq_len=8), ShapeJSON(packed=(3, 4))), time_ms=9.0),),
)


def _write(tmp_path, raw) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_round_trip_is_exact_and_deterministic(tmp_path):
    profile = PROFILE.model_copy(update={"records": RECORDS})
    path = tmp_path / "a.json"
    write_profile(profile, path)
    assert read_profile(path) == profile
    first = path.read_text()
    write_profile(read_profile(path), path)
    assert path.read_text() == first
    assert json.loads(first)["schema_version"] == 1
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_shapes_map_to_micro_batches():
    assert RECORDS.layer[0].shape == MicroBatchShape.padded(2, 64)
    assert RECORDS.layer[1].shape == MicroBatchShape.packed([30, 70])
    assert ShapeJSON.of(MicroBatchShape.packed([5])).packed == (5,)


def _raw():
    return PROFILE.model_copy(update={"records": RECORDS}).model_dump(mode="json")


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda r: r.pop("schema_version"), "schema_version"),
        (lambda r: r.update(schema_version=2), "schema_version"),
        (lambda r: r.update(kind="guessed"), "kind"),
        (lambda r: r["records"]["layer"][1].update(time_ms=-1), "records.layer[1].time_ms"),
        (lambda r: r["records"]["layer"][0].update(packed=[3]), "records.layer[0]"),
        (lambda r: r["records"]["replica"][0].update(microbatches=[]), "records.replica[0].microbatches"),
        (lambda r: r["memory"][0].pop("max_tokens"), "memory[0].max_tokens"),
        (lambda r: r["adapters"]["tasks"][0].update(targets=["lm_head"]), "adapters.tasks[0]"),
        (lambda r: r["coefficients"]["layer_ms"].update({"1": [1.0, 2.0]}), "coefficients"),
        (lambda r: r.update(surprise=1), "surprise"),
    ],
)
def test_bad_files_name_file_and_field(tmp_path, mutate, field):
    raw = _raw()
    mutate(raw)
    path = _write(tmp_path, raw)
    with pytest.raises(InputError) as err:
        read_profile(path)
    assert err.value.path == path
    assert err.value.field.startswith(field), err.value
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text,message", [("{", "not valid JSON"), ("[1]", "JSON object")])
def test_not_a_profile(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        read_profile(path)
    with pytest.raises(InputError, match="no such file"):
        read_profile(tmp_path / "missing.json")


def test_analytic_profile_needs_coefficients():
    with pytest.raises(ValueError, match="coefficients"):
        Profile.model_validate({**_raw(), "coefficients": None})


def test_layer_csv(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("tp,seq_len,mbs,time,note\n1,128,4,3.5,x\n2,256,1,,y\n")
    rows = read_layer_csv(path)
    assert [(r.tp, r.pp, r.seq_len, r.mbs, r.time) for r in rows] == [(1, 1, 128, 4, 3.5), (2, 1, 256, 1, None)]
    path.write_text("tp,seq_len,mbs\n1,128,0\n")
    with pytest.raises(InputError, match="line 2: mbs"):
        read_layer_csv(path)
    path.write_text("tp,mbs\n1,2\n")
    with pytest.raises(InputError, match="seq_len: missing column"):
        read_layer_csv(path)


def test_forward_records_are_optional_and_fitted_where_measured(tmp_path):
    """A profile that timed the forward alone fits its t_F(b, s) and head line (what prices an evaluation); one that
    did not (every profile before them) has no such key in its JSON and keeps the assumed shares."""
    full, forward = (
        LayerTimeCoeffs((2e-6, 0.0, 3e-3, 0.0, 1e-2, 0.5)),
        LayerTimeCoeffs((5e-7, 0.0, 1e-3, 0.0, 4e-3, 0.2)),
    )
    grid = [MicroBatchShape.padded(b, s) for s in (16, 64, 256) for b in (1, 2, 4)]
    grid.append(MicroBatchShape.packed([30, 70, 120]))

    def layers(c: LayerTimeCoeffs) -> tuple[LayerRecord, ...]:
        return tuple(LayerRecord(**ShapeJSON.of(mb).model_dump(), tp=1, time_ms=c.shape(mb)) for mb in grid)

    def heads(fixed: float, slope: float) -> tuple[HeadRecord, ...]:
        return tuple(HeadRecord(tp=1, tokens=n, time_ms=fixed + slope * n) for n in (16, 64, 256, 1024))

    measured = PROFILE.model_copy(
        update={"kind": "measured", "coefficients": None, "memory": tuple(m for m in PROFILE.memory if m.tp == 1)}
    )
    without = measured.model_copy(update={"records": Records(layer=layers(full), head=heads(0.3, 2e-3))})
    path = tmp_path / "without.json"
    write_profile(fit_profile(without), path)
    raw = json.loads(path.read_text())
    assert "layer_forward" not in raw["records"] and "forward_layer_ms" not in raw["coefficients"]
    config, mbs = ParallelConfig(1, 1), [MicroBatchShape.padded(2, 100)]
    shares = profile_cost_model(read_profile(path), MODEL_PRESETS["tiny-llama"])
    assert shares.forward_time(config, mbs) == pytest.approx(shares.stage_coeffs(config).forward().shapes(mbs)[0] / 1e3)

    records = without.records.model_copy(update={"layer_forward": layers(forward), "head_forward": heads(0.1, 8e-4)})
    fitted = fit_profile(measured.model_copy(update={"records": records}))
    write_profile(fitted, path)
    assert read_profile(path) == fitted
    assert fitted.coefficients.forward_layer_ms[1] == pytest.approx(forward.c, rel=1e-3, abs=1e-9)
    assert fitted.coefficients.forward_head_ms[1].slope == pytest.approx(8e-4, rel=1e-3)
    assert fitted.quality["forward_layer_cv"]["median"] < 1e-3
    cm = profile_cost_model(fitted, MODEL_PRESETS["tiny-llama"])
    expected = MODEL_PRESETS["tiny-llama"].n_layers * forward(2, 100) + 0.1 + 8e-4 * 200
    assert cm.forward_time(config, mbs) == pytest.approx(expected / 1e3, rel=1e-3)
    raw = json.loads(path.read_text())
    raw["coefficients"]["forward_head_ms"] = {}
    with pytest.raises(InputError, match="same TP degrees"):
        read_profile(_write(tmp_path, raw))
