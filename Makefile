# hvdtrain: `make run` sets everything up and trains the default recipe; `make test` runs lint and all tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NP ?= 2
RECIPE ?= digits-mlp-torch
PYTEST_ARGS ?=

.PHONY: install system-deps venv horovod run test unit integration lint format bench gpu-check image image-test clean

install: system-deps venv horovod

system-deps:
	@containers/system-deps.sh

# The venv is (re)made when pyproject.toml changes; torch comes pinned (a CPU build), see versions.env.
$(BIN)/.installed: pyproject.toml containers/versions.env
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	$(BIN)/python -m pip install --quiet -e '.[torch,tf,mpi,ray,dev]'
	@touch $@

venv: $(BIN)/.installed

horovod: system-deps venv
	$(BIN)/python containers/build_horovod.py --python $(BIN)/python

run: install
	$(BIN)/hvdtrain run $(RECIPE) --np $(NP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

unit: venv
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

integration: install
	$(BIN)/python -m pytest tests/integration -q $(PYTEST_ARGS)

test: install lint
	$(BIN)/python -m pytest tests -q $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m hvdtrain.bench

# On a CUDA machine: Horovod with NCCL in .venv-gpu, digits and synthetic on every GPU, horovod vs ddp.
gpu-check: system-deps
	$(PYTHON) containers/gpu_check.py

# The CPU image (containers/Dockerfile.cpu) with docker, or buildah where containers cannot start.
image:
	$(PYTHON) containers/image.py build

image-test:
	$(PYTHON) containers/image.py test

clean:
	rm -rf $(VENV) .venv-gpu runs .pytest_cache
