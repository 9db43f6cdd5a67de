# One virtual environment in the repository; torch pinned to the CPU build this kind of
# machine keeps on disk (GPU users install their own CUDA build: the package asks only torch>=2.11).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint typecheck bench gpu

setup: $(VENV)/.installed

# examples/ring_backend is a backend outside xgrad, registered through its entry point
# alone: installing it is all it takes for the conformance tests and `xgrad crosscheck`.
$(VENV)/.installed: pyproject.toml examples/ring_backend/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[torch,jax,test,plot]" -e examples/ring_backend
	touch $@

demo: setup
	$(VENV)/bin/xgrad crosscheck

lint: setup
	$(VENV)/bin/ruff check xgrad tests examples
	$(VENV)/bin/ruff format --check xgrad tests examples

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest

bench: setup
	$(VENV)/bin/xgrad bench ddp

# CUDA: the GPU tests and the crosscheck on the GPUs (torch on NCCL, one process per GPU;
# JAX on the same GPUs with its preallocation off), each runner also compared with its
# own CPU run. Uses the existing environment (no network; `make gpu PY=python3` takes
# another interpreter's, with the repository on PYTHONPATH); without a GPU it says so and
# exits 0. .ci/gpu runs the same, then the benchmarks, each step bounded (a borrowed GPU).
gpu:
	@command -v $(PY) >/dev/null || { echo "make gpu: no $(PY): run 'make setup' first"; exit 2; }
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  n=$$($(PY) -c "import torch; print(torch.cuda.device_count())"); \
	  echo "make gpu: $$n CUDA device(s); GPU tests, then xgrad crosscheck --device cuda --world-size $$n"; \
	  JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -m gpu -q -rs && \
	  mkdir -p xgrad-out && XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m xgrad crosscheck --device cuda \
	    --world-size $$n --out xgrad-out/gpu; \
	else \
	  echo "make gpu: skipped: no CUDA device here (torch.cuda.is_available() is False)"; \
	fi
