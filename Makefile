# hvdtrain: `make run` sets everything up and trains the default recipe; `make test` runs lint, the docs
# build and all tests; `make check` is the fast tier (lint, unit and in-process tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NP ?= 2
RECIPE ?= digits-mlp-torch
PYTEST_ARGS ?=
BENCH ?=

# Every process writes the bytecode of what it imports, the first time, even where the machine sets
# PYTHONDONTWRITEBYTECODE: otherwise each rank and test process compiles torch and TensorFlow again.
# So pip installs without compiling the venv's tens of thousands of files, most never imported.
export PYTHONDONTWRITEBYTECODE :=

# cuda where nvidia-smi lists a GPU, else cpu: with cuda, `make install` builds Horovod with NCCL
# against PyPI's CUDA build of torch (containers/build_horovod.py). HVDTRAIN_DEVICE=cuda or cpu chooses.
HVDTRAIN_DEVICE ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo cuda || echo cpu)
export HVDTRAIN_DEVICE

.PHONY: install system-deps venv horovod run check test unit inprocess integration lint format bench gpu-wheel gpu-check device-bundle device-rehearsal image image-test clean docs

install: system-deps venv horovod

system-deps:
	@containers/system-deps.sh

# The venv is (re)made when pyproject.toml changes; torch comes pinned (a CPU build), see versions.env.
$(BIN)/.installed: pyproject.toml hvdtrain/building/versions.env
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	$(BIN)/python -m pip install --quiet --no-compile -e '.[torch,tf,mpi,ray,mlflow,sweep,dev,docs]'
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

# The fast tier, for every edit: lint, unit and in-process tests (no ranks, no Horovod build needed).
check: lint
	$(BIN)/python -m pytest tests/unit tests/inprocess -q $(PYTEST_ARGS)

unit: venv
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

inprocess: venv
	$(BIN)/python -m pytest tests/inprocess -q $(PYTEST_ARGS)

integration: install
	$(BIN)/python -m pytest tests/integration -q $(PYTEST_ARGS)

# Everything CI runs: every tier, none skipped, the slowest twenty named; four workers, grouped as
# tests/conftest.py says.
test: install lint docs
	$(BIN)/python -m pytest tests -q --durations=20 -n 4 $(PYTEST_ARGS)

# The user guide (docs/, mkdocs.yml) into site/; strict, so a broken link or anchor fails it
# (not --quiet: it hides the warnings that strict mode counts).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The project's benchmark suite (benchmarks/, not in the wheel); BENCH="startup allreduce" runs only those.
bench: install
	$(BIN)/python -m benchmarks $(BENCH)

# The CUDA build on any machine, no GPU needed: .venv-gpu with PyPI's CUDA torch and toolkit, Horovod
# with NCCL compiled and cached by key like the CPU wheel, and doctor's check that NCCL is built.
gpu-wheel:
	$(MAKE) horovod VENV=.venv-gpu HVDTRAIN_DEVICE=cuda

# On a CUDA machine: resnet-torch and gpt-torch on every GPU, horovod against ddp and fsdp, fp32 and bf16.
gpu-check: gpu-wheel
	.venv-gpu/bin/python containers/gpu_check.py

# For an offline GPU machine: .device/ gets Horovod's sdist and the wheels hvdtrain needs beyond the
# machine's image (containers/device_bundle.py); there `build_horovod.py --offline --sdist` builds.
device-bundle:
	$(PYTHON) containers/device_bundle.py

# The device check rehearsed on this CPU, offline, from the bundle: Horovod (Gloo only, as on a machine
# without MPI) built from the bundle's sdist into .venv-rehearsal, a venv of its own that sees the
# main venv's packages, hvdtrain installed there, then every check at toy sizes (runs/device-check/).
REHEARSAL := .venv-rehearsal
device-rehearsal: device-bundle venv
	@test -x $(REHEARSAL)/bin/python || $(PYTHON) -m venv $(REHEARSAL)
	$(BIN)/python -c 'import site; print(f"import site; site.addsitedir({site.getsitepackages()[0]!r})")' \
		> $$($(REHEARSAL)/bin/python -c 'import site; print(site.getsitepackages()[0])')/hvdtrain-main-venv.pth
	rm -rf build/horovod-cache  # the rehearsal builds, as a fresh GPU machine does
	PYTHON=$(REHEARSAL)/bin/python containers/device_check.sh --toy --controllers gloo --budget 2400

# The CPU image (containers/Dockerfile.cpu) with docker, or buildah where containers cannot start.
image:
	$(PYTHON) containers/image.py build

image-test:
	$(PYTHON) containers/image.py test

clean:
	rm -rf $(VENV) .venv-gpu $(REHEARSAL) runs .pytest_cache site
