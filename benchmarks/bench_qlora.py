"""A quantized shared base (QLoRA, issue #41) against bitsandbytes and PEFT, side by side in one process.

What only a GPU with bitsandbytes can price, in three tables (``scripts/gpu_check.sh``, part ``qlora``):

1. **dequantization**: one projection of Llama-2-7B's width (q 4096x4096, gate 11008x4096, down 4096x11008), forward
   and backward (dX) of T tokens: the plain linear (``bf16``), ours over NF4 (dequantize in torch, then one GEMM:
   ``QuantizedLinear``) and bitsandbytes' ``Linear4bit``; each time over the plain one's, beside the analytic model's
   dequantization factor for a whole 7B block at that token count (``costmodel.analytic``, ``quantize=nf4``).
2. **bytes**: our NF4 (``executor/torch/quant.py``) of every projection of the peer model below against the bytes
   bitsandbytes' CUDA kernel wrote when ``from_pretrained(quantization_config=BitsAndBytesConfig(nf4))`` loaded the
   same weights (``scripts/quant_golden.py`` checked its CPU path only): packed bytes and absmax equal, and the
   dequantized weights' largest difference.
3. **peer step**: one QLoRA training step (forward, backward, AdamW) of one rank-16 task on every projection of a
   Llama of 7B width and ``--layers`` blocks, one batch of ``--batch`` x ``--seq`` tokens: lorafleet's operator over
   our NF4 base (``quantize_base`` + ``inject_multi_lora``) against PEFT over bitsandbytes' 4-bit base (loaded as
   a PEFT user loads it, no ``prepare_model_for_kbit_training``: neither side recomputes); tokens a second of each
   and the ratio, and the largest logit gap between the two quantized models before training.

Every time is a median of interleaved repeats (``bench_multi_lora.measure``), read after ``torch.cuda.synchronize()``
on CUDA. Without bitsandbytes (this CPU machine) the bitsandbytes columns say so and the peer is PEFT over the
dequantized base (the exactness tests' reference), so the script runs end to end on CPU as a smoke test:

    python benchmarks/bench_qlora.py --device cuda --dtype bf16          # on a lent GPU (gpu_check.sh)
    python benchmarks/bench_qlora.py --device cpu --dtype fp32 --quick   # smoke: tiny shapes, no bitsandbytes
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_multi_lora import cuda_clock, measure  # noqa: E402

from lorafleet.costmodel.adapters import AdapterLoad  # noqa: E402
from lorafleet.costmodel.analytic import analytic_layer_time  # noqa: E402
from lorafleet.costmodel.time_model import MicroBatchShape  # noqa: E402
from lorafleet.executor.torch.base_model import llama_config  # noqa: E402
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers, segments_context  # noqa: E402
from lorafleet.executor.torch.peft_export import lora_config  # noqa: E402
from lorafleet.executor.torch.quant import NF4_BLOCKSIZE, dequantize_nf4, quantize_nf4  # noqa: E402
from lorafleet.executor.torch.quantized_base import QuantizedLinear, dequantized_copy, quantize_base  # noqa: E402
from lorafleet.executor.torch.routing import Segments  # noqa: E402
from lorafleet.specs.gpus import gpu_preset_for, resolve_gpu  # noqa: E402
from lorafleet.specs.lora import LLAMA_TARGET_MODULES, LoraSpec, Quantization  # noqa: E402
from lorafleet.specs.model import MODEL_PRESETS  # noqa: E402

LLAMA7B = MODEL_PRESETS["llama2-7b"]
TASK = LoraSpec(rank=16, alpha=32)
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def bnb_model(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``model`` as a PEFT user gets it over bitsandbytes' NF4: saved, then ``from_pretrained`` with
    ``BitsAndBytesConfig(load_in_4bit, nf4, no double quantization, compute dtype = dtype)``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=dtype
    )
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=config, dtype=dtype, device_map={"": device.index or 0}, attn_implementation="sdpa"
        )
    return loaded.eval().requires_grad_(False)


def table_bytes(model: nn.Module, quantized: nn.Module | None, device: torch.device) -> None:
    """Table 2 (module doc)."""
    print("\n2. NF4 bytes: ours (quant.py) against bitsandbytes' CUDA quantization of the same weights")
    if quantized is None:
        print("   skipped: bitsandbytes is not installed")
        return
    import bitsandbytes.functional as bnbf

    equal, total, gap = 0, 0, 0.0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in LLAMA_TARGET_MODULES:
            continue
        theirs = quantized.get_submodule(name)
        ours = quantize_nf4(module.weight.detach().to(device))
        state = theirs.weight.quant_state
        same = torch.equal(ours.packed.view(-1), theirs.weight.data.view(-1)) and torch.equal(
            ours.absmax, state.absmax.float()
        )
        deq = bnbf.dequantize_4bit(theirs.weight.data, state).float()
        gap = max(gap, float((dequantize_nf4(ours, torch.float32) - deq).abs().max()))
        equal += same
        total += 1
    print(f"   {equal} of {total} projections byte for byte equal; dequantized weights differ by at most {gap:.3g}")


def table_dequantization(
    args: argparse.Namespace, dtype: torch.dtype, device: torch.device, clock, gpu_name: str | None
) -> None:
    """Table 1 (module doc)."""
    shapes = {"q 4096x4096": (4096, 4096), "gate 11008x4096": (11008, 4096), "down 4096x11008": (4096, 11008)}
    tokens = (512, 4096)
    if args.quick:
        shapes, tokens = {"q 256x256": (256, 256), "down 256x704": (256, 704)}, (64,)
    gpu = resolve_gpu(gpu_name or "a100-40gb")
    print(
        f"\n1. dequantization: one projection, fwd+bwd (dX) of T tokens, {args.dtype}; time over the plain layer's "
        f"(analytic: a whole 7B block on {gpu.name})"
    )
    print(f"{'projection':<18} {'T':>5} {'plain ms':>9} {'ours nf4':>9} {'bnb nf4':>9} {'analytic':>9}")
    for label, (n, k) in shapes.items():
        linear = nn.Linear(k, n, bias=False, device=device, dtype=dtype).requires_grad_(False)
        ours = QuantizedLinear.of(linear, Quantization.NF4)
        theirs = None
        if HAS_BNB and device.type == "cuda":
            import bitsandbytes as bnb

            theirs = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, quant_type="nf4")
            theirs.weight = bnb.nn.Params4bit(linear.weight.detach().cpu(), requires_grad=False, quant_type="nf4")
            theirs = theirs.to(device)
        for t in tokens:
            x = torch.randn(t, k, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(t, n, device=device, dtype=dtype)

            def step(layer: nn.Module, x: torch.Tensor = x, grad: torch.Tensor = grad):
                def run() -> None:
                    x.grad = None
                    layer(x).backward(grad)

                return run

            steps = {"plain": step(linear), "ours": step(ours)}
            if theirs is not None:
                steps["bnb"] = step(theirs)
            median = measure(steps, 50 if not args.quick else 5, args.row_seconds, clock, warmups=2)
            load = AdapterLoad.uniform(1)
            shape = MicroBatchShape.padded(1, t)
            factor = analytic_layer_time(LLAMA7B, gpu, 1, load, quantize=Quantization.NF4).shape(
                shape
            ) / analytic_layer_time(LLAMA7B, gpu, 1, load).shape(shape)
            bnb_cell = f"{median['bnb'] / median['plain']:>8.2f}x" if "bnb" in median else f"{'n/a':>9}"
            print(
                f"{label:<18} {t:>5} {median['plain'] * 1e3:>9.3f} {median['ours'] / median['plain']:>8.2f}x "
                f"{bnb_cell} {factor:>8.2f}x",
                flush=True,
            )


def table_peer(args: argparse.Namespace, dtype: torch.dtype, device: torch.device, clock) -> None:
    """Table 3 (module doc)."""
    width = LLAMA7B if not args.quick else MODEL_PRESETS["tiny-llama"]
    spec = width.model_copy(update={"n_layers": args.layers})
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # drawn on the device: a 4-block 7B-wide model's init takes minutes on a host core
        base = LlamaForCausalLM(llama_config(spec)).to(dtype).eval().requires_grad_(False)
    ids = torch.randint(3, spec.vocab, (args.batch, args.seq), device=device)

    ours = copy.deepcopy(base)
    quantize_base(ours, Quantization.NF4)
    inject_multi_lora(ours, [TASK], seeds=[0])
    for _, layer in multi_lora_layers(ours):
        layer.train()
    segments = Segments.padded([0] * args.batch, [args.seq] * args.batch, args.seq)

    import peft

    if HAS_BNB and device.type == "cuda":
        peer_base, peer_name = bnb_model(base, dtype, device), "PEFT + bitsandbytes NF4"
        table_bytes(base, peer_base, device)
    else:
        peer_base, peer_name = dequantized_copy(copy.deepcopy(base), Quantization.NF4), "PEFT (dequantized)"
        table_bytes(base, None, device)
    with torch.no_grad(), segments_context(ours, segments):
        gap = float((ours(ids).logits.float() - peer_base(ids).logits.float()).abs().max())
    peer = peft.get_peft_model(peer_base, lora_config(TASK))
    optimizers = {
        "ours": torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-4),
        "peer": torch.optim.AdamW([p for p in peer.parameters() if p.requires_grad], lr=1e-4),
    }

    def step(name: str, model: nn.Module):
        def run() -> None:
            if name == "ours":
                with segments_context(model, segments):
                    logits = model(ids).logits
            else:
                logits = model(input_ids=ids).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)

        return run

    median = measure(
        {"ours": step("ours", ours), "peer": step("peer", peer)}, 20 if not args.quick else 3, args.row_seconds, clock
    )
    tokens = args.batch * args.seq
    print(
        f"\n3. peer step: one rank-16 task on every projection, {args.layers} blocks of width {spec.hidden}, "
        f"{args.batch}x{args.seq} tokens, {args.dtype}"
    )
    print(f"   logits before training: ours over our NF4 against {peer_name}: largest gap {gap:.3g}")
    print(f"   ours  {median['ours'] * 1e3:9.2f} ms  {tokens / median['ours']:10.0f} tokens/s")
    print(f"   peer  {median['peer'] * 1e3:9.2f} ms  {tokens / median['peer']:10.0f} tokens/s  ({peer_name})")
    print(f"   ours / peer tokens a second: {median['peer'] / median['ours']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--layers", type=int, default=4, help="blocks of the peer model (default 4)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--row-seconds", type=float, default=3.0, help="timed seconds per row, all sides together")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    clock = cuda_clock if device.type == "cuda" else time.perf_counter
    gpu_name = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu_name = gpu_preset_for(props.name, props.total_memory)
        print(f"{props.name}, {args.dtype}, bitsandbytes {'present' if HAS_BNB else 'MISSING'}")
    else:
        print(
            f"CPU, {args.dtype}, {torch.get_num_threads()} threads, bitsandbytes {'present' if HAS_BNB else 'MISSING'}"
        )
    print(f"NF4 blocks of {NF4_BLOCKSIZE}, no double quantization (bitsandbytes' layout: quant.py)")
    table_dequantization(args, dtype, device, clock, gpu_name)
    table_peer(args, dtype, device, clock)


if __name__ == "__main__":
    main()
