# One virtual environment in the repository; torch pinned to the CPU build this kind of
# machine keeps on disk (GPU users install their own CUDA build: the package asks only torch>=2.4).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint typecheck bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[torch,jax,test,plot]"
	touch $@

demo: setup
	$(VENV)/bin/xgrad crosscheck

lint: setup
	$(VENV)/bin/ruff check xgrad tests
	$(VENV)/bin/ruff format --check xgrad tests

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest

bench: setup
	$(VENV)/bin/xgrad bench ddp
