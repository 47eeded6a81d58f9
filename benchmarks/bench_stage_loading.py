"""Host memory of building one pipeline stage: the whole-model path against per-stage loading.

A random Llama (default: 12 layers, width 768, vocab 8192: 88M parameters, 169 MiB in bf16, as
HF checkpoints mostly are) is saved once with ``save_pretrained(safe_serialization=True)``.
Then a world of ``tp * pp`` gloo processes is started twice, as fresh subprocesses, for a plan
of one replica ``(tp, pp)``: each rank builds its stage with ``build_replica``, in ``--dtype``
(fp32, what ``lorafleet train`` uses), from the whole model (``load_causal_lm``) or per stage
(``load_base``: a meta skeleton, then only the stage's slices read from the checkpoint). Each
rank reports its peak resident set (``ru_maxrss``) and the same figure right before loading
(after importing torch and transformers and joining the world); the script prints both per
rank and the whole/stage ratios of the peaks and of the growth above that baseline.

    .venv/bin/python benchmarks/bench_stage_loading.py            # tp 1, pp 4, bf16 -> fp32
    .venv/bin/python benchmarks/bench_stage_loading.py --tp 2 --pp 2
    .venv/bin/python benchmarks/bench_stage_loading.py --checkpoint-dtype fp32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("whole", "stage")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def save_model(directory: Path, layers: int, hidden: int, vocab: int, dtype: str) -> int:
    """Saves the random Llama once (kept across runs); returns its checkpoint bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    weights = directory / "model.safetensors"
    if not weights.is_file():
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 8 // 3,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 192,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(getattr(torch, DTYPES[dtype])).save_pretrained(directory, safe_serialization=True)
    return weights.stat().st_size


def rank_main(mode: str, rank: int, tp: int, pp: int, directory: str, init_file: str, dtype: str) -> None:
    """One rank: join the world, build the stage, print one JSON line of its memory."""
    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401  (in the baseline, as torch is)

    from lorafleet.costmodel.parallel_config import ParallelConfig
    from lorafleet.data.model_source import ModelSource, SourceKind
    from lorafleet.executor.torch.base_model import load_base, load_causal_lm
    from lorafleet.executor.torch.replica import build_replica
    from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec
    from lorafleet.specs.lora import LoraSpec

    torch.set_num_threads(1)
    world = tp * pp
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    plan = DeploymentPlan(
        model=directory,
        pools=(PlanPool("", "cpu", world, world),),
        tasks=("a", "b"),
        replicas=(ReplicaSpec(0, ParallelConfig(tp, pp), 4096, tuple(range(world))),),
        bucket_boundaries=(),
        expected_makespan_s=0.0,
    )
    source = ModelSource(kind=SourceKind.HF_DIR, name=directory, path=directory)
    adapters = [LoraSpec(rank=16, alpha=32), LoraSpec(rank=8, alpha=8, target_modules=("q_proj", "v_proj"))]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch_dtype = getattr(torch, DTYPES[dtype])
    if mode == "whole":
        model, weights = load_causal_lm(source, torch_dtype), None
    else:
        model, weights = load_base(source, torch_dtype)
    replica = build_replica(
        model, adapters, plan, rank, world, seeds=range(len(adapters)), device=torch.device("cpu"), weights=weights
    )
    tensors = [*replica.model.parameters(), *replica.model.buffers()]
    # Read every value once, as the first forward would: a tensor that still maps the checkpoint
    # file (safetensors and from_pretrained map it, and copy only what they convert or slice)
    # is resident only once touched.
    checksum = sum(float(t.detach().float().sum()) for t in tensors)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = sum(t.numel() * t.element_size() for t in tensors)
    print(
        json.dumps(
            {
                "rank": rank,
                "stage": replica.role.stage,
                "tp_rank": replica.role.tp_rank,
                "baseline_kb": baseline,
                "peak_kb": peak,
                "held_bytes": held,
                "checksum": checksum,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


def run_world(mode: str, tp: int, pp: int, directory: Path, dtype: str) -> list[dict]:
    """Starts the world's ranks as fresh subprocesses; their reports, by rank."""
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        init_file = str(Path(tmp) / "init")
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-main",
                    mode,
                    str(r),
                    str(tp),
                    str(pp),
                    str(directory),
                    init_file,
                    dtype,
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(tp * pp)
        ]
        reports = []
        for proc in procs:
            out, _ = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"a {mode} rank failed (exit {proc.returncode})")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(reports, key=lambda r: r["rank"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        mode, rank, tp, pp, directory, init_file, dtype = sys.argv[2:]
        rank_main(mode, int(rank), int(tp), int(pp), directory, init_file, dtype)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--save":
        directory, layers, hidden, vocab, dtype = sys.argv[2:]
        print(save_model(Path(directory), int(layers), int(hidden), int(vocab), dtype))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--checkpoint-dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="of the built stage")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "lorafleet-bench-stage-loading",
        help="where the checkpoint is saved (kept; delete it to rebuild)",
    )
    args = parser.parse_args()
    directory = args.dir / f"llama-{args.layers}x{args.hidden}-v{args.vocab}-{args.checkpoint_dtype}"
    # Everything that imports torch runs in a child: a child inherits its parent's peak RSS
    # across exec (Linux keeps ru_maxrss), so this process must never hold a model.
    saved = subprocess.run(
        [
            sys.executable,
            __file__,
            "--save",
            str(directory),
            str(args.layers),
            str(args.hidden),
            str(args.vocab),
            args.checkpoint_dtype,
        ],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    size = int(saved.stdout.strip().splitlines()[-1])
    print(
        f"checkpoint {directory}: {size / 2**20:.0f} MiB; plan: one replica tp={args.tp} pp={args.pp}; "
        f"stage in {args.dtype}"
    )
    reports = {mode: run_world(mode, args.tp, args.pp, directory, args.dtype) for mode in MODES}
    mib = 1 / 1024  # ru_maxrss is in KiB on Linux
    print(
        f"{'rank':>4} {'stage':>5} {'holds MiB':>9} | {'whole peak':>10} {'stage peak':>10} {'ratio':>6} |"
        f" {'whole +':>8} {'stage +':>8} {'ratio':>6}   (MiB; '+': peak minus the rank's baseline)"
    )
    for w, s in zip(reports["whole"], reports["stage"], strict=True):
        assert w["checksum"] == s["checksum"], f"rank {w['rank']}: the two stages differ"
        grow_w, grow_s = w["peak_kb"] - w["baseline_kb"], s["peak_kb"] - s["baseline_kb"]
        print(
            f"{w['rank']:>4} {w['stage']:>5} {s['held_bytes'] / 2**20:>9.0f} | {w['peak_kb'] * mib:>10.0f}"
            f" {s['peak_kb'] * mib:>10.0f} {w['peak_kb'] / s['peak_kb']:>5.2f}x | {grow_w * mib:>8.0f}"
            f" {grow_s * mib:>8.0f} {grow_w / max(grow_s, 1):>5.2f}x"
        )


if __name__ == "__main__":
    main()
