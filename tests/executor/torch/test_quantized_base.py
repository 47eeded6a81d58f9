"""Training over a quantized shared base (``executor/torch/quantized_base.py``): the layer, its TP slices, and joint
training over NF4 and int8 bases equal to each task trained alone with PEFT over the same quantized base's function
(the dequantized weights: what bitsandbytes' Linear4bit / Linear8bitLt compute with; bitsandbytes itself is not
installed in this environment)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from lorafleet.cli import main
from lorafleet.data.model_source import ModelSource, SourceKind
from lorafleet.errors import InputError
from lorafleet.executor.torch.checkpoint import latest_step_dir
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers
from lorafleet.executor.torch.peft_export import SAFETENSORS_WEIGHTS_NAME
from lorafleet.executor.torch.quantized_base import QuantizedLinear, dequantized_copy, quantize_base
from lorafleet.executor.torch.quantized_stage import load_quantized_base
from lorafleet.runtime.base_quantization import check_quantizable
from lorafleet.specs.lora import Quantization
from lorafleet.specs.workload import WorkloadSpec
from tests.executor.torch.test_dora import DORA_TASKS
from tests.helpers import fleet_harness as h
from tests.helpers.repo import SMALL_WORKLOAD
from tests.helpers.trained_alone import ATOL, STEPS, _max_diff, train_alone


@pytest.mark.parametrize("kind", list(Quantization))
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_slices_are_the_whole_layers_values(kind, dim):
    """A TP shard holds exactly the whole quantized layer's values (cut from the stored bytes, not re-quantized)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    whole = QuantizedLinear.of(linear, kind)
    parts = [whole.sliced(dim, r, 2, keep_bias=True) for r in range(2)]
    torch.testing.assert_close(torch.cat([p.weight for p in parts], dim=dim), whole.weight, rtol=0, atol=0)
    assert not torch.equal(whole.weight, linear.weight)  # it is quantized
    if kind is Quantization.NF4:
        with pytest.raises(ValueError, match="NF4 blocks of 64 do not split"):
            QuantizedLinear.of(nn.Linear(96, 8), kind).sliced(1, 0, 2, keep_bias=True)


def test_the_quantized_model_computes_the_dequantized_one():
    base = h.build_model()
    quantized = quantize_base(copy.deepcopy(base), Quantization.NF4)
    assert len(quantized) == 7 * 4
    model = copy.deepcopy(base)
    quantize_base(model, Quantization.NF4)
    inject_multi_lora(model, [t.lora for t in DORA_TASKS], seeds=[1, 2, 3, 4])
    assert all(isinstance(layer.base_layer, QuantizedLinear) for _, layer in multi_lora_layers(model))
    reference = dequantized_copy(copy.deepcopy(base), Quantization.NF4)
    ids = torch.randint(0, h.VOCAB, (2, 9))
    with torch.no_grad():
        frozen = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        for name, module in frozen.items():
            theirs = reference.get_submodule(name.removesuffix(".base_layer")).weight
            assert torch.equal(module.weight, theirs), name
        assert (reference(ids).logits - base(ids).logits).abs().max() > 1e-3  # quantizing changed the function


QUANT_RUNS = {
    "int8 tp2+pp2": (Quantization.INT8, h.plan_of((2, 1), (1, 2))),
    "nf4 pp2+tp1+tp1": (Quantization.NF4, h.plan_of((1, 2), (1, 1), (1, 1))),
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-fleet")
    runs = {
        name: h.Run(plan, STEPS, out=str(root / str(i)), tasks=DORA_TASKS, quantize=kind)
        for i, (name, (kind, plan)) in enumerate(QUANT_RUNS.items())
    }
    h.run_world(4, list(runs.values()), root)
    out = {}
    for name, run in runs.items():
        final = latest_step_dir(Path(run.out) / "final")
        out[name] = {t.name: load_file(final / t.name / SAFETENSORS_WEIGHTS_NAME) for t in DORA_TASKS}
    return out


@pytest.mark.parametrize("run", list(QUANT_RUNS))
def test_joint_training_over_a_quantized_base_equals_each_task_alone(fleet, run):
    """DoRA, LoRA+ and VeRA tenants over one quantized base, on TP and PP replicas == each alone with PEFT over the
    same quantized base's function, within 1e-5 (fp32); and the quantized base did change what was learnt."""
    kind = QUANT_RUNS[run][0]
    for i, task in enumerate(DORA_TASKS):
        alone = train_alone(i, torch.float32, tasks=DORA_TASKS, quantize=kind)
        assert _max_diff(fleet[run][task.name], alone) <= ATOL[torch.float32], task.name
        if i == 0:
            unquantized = train_alone(i, torch.float32, tasks=DORA_TASKS)
            assert _max_diff(alone, unquantized) > 20 * ATOL[torch.float32]


def test_a_workload_asks_for_it_and_the_executor_loads_the_base_quantized(tmp_path, capsys):
    """``quantize:`` in a workload (nf4 | int8, one line and exit 2 otherwise); the executor's loader quantizes the
    whole base; a GGUF source (already quantized, dequantized on load) is refused."""
    raw = json.loads(json.dumps(SMALL_WORKLOAD))
    assert WorkloadSpec.model_validate({**raw, "quantize": "nf4"}).quantize is Quantization.NF4
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({**raw, "quantize": "fp4"}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "quantize" in err and "nf4" in err, err
    model, weights = load_quantized_base(h.TINY, torch.float32, Quantization.INT8)
    assert weights is None and sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 7 * 4
    gguf = ModelSource(kind=SourceKind.GGUF, name="m.gguf", path=str(tmp_path), gguf_file="m.gguf")
    with pytest.raises(InputError, match="workload: quantize: nf4: 'm.gguf' is a GGUF file"):
        check_quantizable(gguf, Quantization.NF4)
    check_quantizable(gguf, None)
    check_quantizable(h.TINY, Quantization.NF4)
