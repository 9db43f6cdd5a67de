# One virtual environment in the repository; torch pinned to the CPU build this kind of
# machine keeps on disk (GPU users install their own CUDA build: the package asks only torch>=2.4).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint typecheck bench

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
