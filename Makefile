# Two commands: `make demo` and `make test`. Both create .venv on first use.
# torch is pinned here (not in pyproject, which keeps a range) because torch==2.13.0
# resolves to the CPU build on these machines instead of a multi-GB CUDA download.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test setup clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/lorafleet validate examples/lobra-7b.yaml

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
