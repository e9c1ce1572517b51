"""Inference backends for the trunk: the part of :class:`~ibedl.core.predictor.Predictor` that turns an encoded
batch into the (B, d) hidden state of each prompt's last real token. The option head, Dirichlet outputs and
abstention stay the predictor's own code whatever the backend.

One module per backend declares it (``BACKEND``: a :class:`~ibedl.core.backends.base.Backend` with its name,
precision, what it needs, how it builds, its calibration key, whether ``auto`` may choose it and whether it is
quantised on a sample), and one line of ``REGISTRY`` (ibedl.core.backends.registry) lists it:
``torch`` (torch_eager: the PEFT model as loaded, on the CPU or CUDA), ``openvino`` (openvino_int8_weights),
``openvino-fp32``, ``openvino-bf16`` and ``openvino-int8`` (static int8), and on CUDA ``torch-cuda-fp32``,
``torch-cuda-bf16`` and ``torch-cuda-nf4-bf16`` (the base and adapter loaded once more in that arithmetic) and
``torch-cuda-merged-fp32`` and ``torch-cuda-merged-bf16`` (the same with the adapter folded into the weights) and
``torch-cuda-graphs-fp32`` and ``torch-cuda-graphs-bf16`` (the merged trunk replayed from CUDA graphs); the
OpenVINO ones share ibedl.core.backends.openvino_ir (export, IR cache, compile), the CUDA ones
ibedl.core.backends.torch_cuda. ``auto`` (the default) is not a backend but a choice among them: the one this machine
runs the artifact fastest on, measured among those the artifact carries a calibration for (ibedl.core.auto_backend;
loading builds nothing: the cached measurement's winner, else torch, until the others are built and timed); ``torch``
when no other can run (MC-Dropout, ensembles, no openvino on the CPU, no calibration made on another arithmetic).

A guarantee is a property of the weights and of the arithmetic that runs them: thresholds and conformal quantiles
are calibrated per backend and precision (:func:`calibration_key`), and the service serves the calibration that
matches its backend (ibedl.core.artifact.Manifest.calibration_for).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ibedl.core.backends.base import Backend, Built, preparation
from ibedl.core.backends.openvino_ir import (
    CompileCrashError,
    LastTokenTrunk,
    OpenVINOBackend,
    OpenVINOTrunk,
    artifact_sample,
    compile_checked,
    compress_int8_groups,
    int8_cached,
    native_bf16,
    runs_openvino,
    sample_digest,
)
from ibedl.core.backends.openvino_ir import ir_path as _ir_path
from ibedl.core.backends.openvino_ir import openvino_trunk as _openvino_trunk
from ibedl.core.backends.registry import (
    BACKENDS,
    DEFAULT_BACKEND,
    REFERENCE,
    REGISTRY,
    check_backend,
    get,
    of_key,
)

log = logging.getLogger(__name__)


def calibration_key(backend: str, device="cpu", dtype="float32", load_in_4bit: bool = False) -> str:
    """The name of the arithmetic a calibration was made on (the manifest's ``calibrated_on`` and the keys of its
    ``backend_calibrations``): an OpenVINO backend's own name (its precision is in it), ``torch-<precision>`` for
    torch on the CPU, ``torch-cuda-[nf4-]<precision>`` on CUDA. ``dtype``: a torch dtype or its name."""
    if check_backend(backend) == "auto":
        raise ValueError("calibration_key needs a concrete backend; resolve auto first (build_trunk)")
    return get(backend).calibration_key(device, dtype, load_in_4bit)


def unavailable(backend: str, predictor, artifact: Path) -> str | None:
    """Why this machine cannot run ``backend`` for ``predictor`` (loaded from ``artifact``), or None when it can."""
    return get(backend).unavailable(predictor, artifact)


def build_trunk(backend: str, predictor, artifact: Path, base_sha256: str) -> Built:
    """What ``predictor`` serves on with the concrete ``backend`` (:meth:`ibedl.core.predictor.Predictor.serve_on`
    applies it), built (its IR exported once when not cached: minutes); ``openvino-int8`` is quantised on the
    artifact's quantisation sample (``Built.quantized_on``: its file's sha256, which its calibration must record).
    ``auto`` is a choice among backends: ibedl.core.auto_backend.build resolves it."""
    if check_backend(backend) == "auto":
        raise ValueError("auto is a choice among backends, not one: ibedl.core.auto_backend.build resolves it")
    artifact = Path(artifact)
    return Built(_build(backend, predictor, artifact, base_sha256), backend, "named", None,
                 get(backend).quantized_on(artifact))


def quantized_on(backend: str, artifact: Path) -> str | None:
    """sha256 of the quantisation sample a ``backend`` trunk of ``artifact`` is made on (static int8), else None."""
    return get(backend).quantized_on(Path(artifact))


def build_one(backend: str, predictor, artifact: Path, base_sha256: str, export: bool = True):
    """The trunk of the concrete ``backend`` (None for torch), its IR exported first when not cached (``export``;
    else FileNotFoundError)."""
    return _build(backend, predictor, Path(artifact), base_sha256, export=export)


def export_ir(backend: str, predictor, artifact: Path, base_sha256: str, copy_model: bool = True) -> Path:
    """Export the IR of ``backend`` for ``predictor`` into the cache (nothing compiled); its directory."""
    return get(backend).export(predictor, Path(artifact), base_sha256, copy_model)


def openvino_trunk(model, tokenizer, artifact: Path, member: str, base_sha256: str, backend: str,
                   threads: int | None = None, sample: list | None = None, export: bool = True) -> OpenVINOTrunk:
    """The compiled trunk of the OpenVINO ``backend`` for a model (``openvino_ir.openvino_trunk`` with the backend
    looked up by name)."""
    return _openvino_trunk(model, tokenizer, artifact, member, base_sha256, _openvino(backend), threads,
                                      sample, export)


def ir_path(artifact: Path, member: str, base_sha256: str, backend: str, sample: list | None = None) -> Path:
    """Where the IR the OpenVINO ``backend`` runs is cached for this adapter (and quantisation sample)."""
    return _ir_path(artifact, member, base_sha256, _openvino(backend).ir, sample)


def _openvino(name: str) -> OpenVINOBackend:
    backend = get(name)
    if not isinstance(backend, OpenVINOBackend):
        raise ValueError(f"backend {name!r} runs no OpenVINO IR")
    return backend


def _build(backend: str, predictor, artifact: Path, base_sha256: str, export: bool = True):
    return get(backend).build(predictor, artifact, base_sha256, export)


__all__ = ["REGISTRY", "BACKENDS", "DEFAULT_BACKEND", "REFERENCE", "Backend", "Built", "preparation",
           "check_backend", "get", "of_key",
           "calibration_key", "unavailable", "build_trunk", "build_one", "export_ir", "quantized_on", "openvino_trunk",
           "ir_path", "runs_openvino", "native_bf16", "int8_cached", "artifact_sample", "sample_digest",
           "compile_checked", "compress_int8_groups", "CompileCrashError", "LastTokenTrunk", "OpenVINOTrunk"]
