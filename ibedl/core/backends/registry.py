"""Every backend, one line each (:data:`REGISTRY`), and the lookups by name or calibration key. Callers ask the
backend they get what they need to know (``auto``, ``build_cost``, ``static_int8``, ``owns_key``:
:class:`~ibedl.core.backends.base.Backend`) rather than test its name. A module of its own so that ``auto``
(ibedl.core.auto_backend) reads the registry without importing what builds the backends, which imports it."""

from __future__ import annotations

from ibedl.core.backends.base import Backend
from ibedl.core.backends.openvino_bf16 import BACKEND as OPENVINO_BF16
from ibedl.core.backends.openvino_fp32 import BACKEND as OPENVINO_FP32
from ibedl.core.backends.openvino_int8 import BACKEND as OPENVINO_INT8
from ibedl.core.backends.openvino_int8_weights import BACKEND as OPENVINO_INT8_WEIGHTS
from ibedl.core.backends.torch_cuda_bf16 import BACKEND as TORCH_CUDA_BF16
from ibedl.core.backends.torch_cuda_fp32 import BACKEND as TORCH_CUDA_FP32
from ibedl.core.backends.torch_cuda_graphs_bf16 import BACKEND as TORCH_CUDA_GRAPHS_BF16
from ibedl.core.backends.torch_cuda_graphs_fp32 import BACKEND as TORCH_CUDA_GRAPHS_FP32
from ibedl.core.backends.torch_cuda_merged_bf16 import BACKEND as TORCH_CUDA_MERGED_BF16
from ibedl.core.backends.torch_cuda_merged_fp32 import BACKEND as TORCH_CUDA_MERGED_FP32
from ibedl.core.backends.torch_cuda_nf4 import BACKEND as TORCH_CUDA_NF4
from ibedl.core.backends.torch_eager import BACKEND as TORCH

# Every backend, one line each (the order the choices are listed in).
REGISTRY: dict[str, Backend] = {b.name: b for b in (
    TORCH,
    OPENVINO_INT8_WEIGHTS,
    OPENVINO_FP32,
    OPENVINO_BF16,
    OPENVINO_INT8,
    TORCH_CUDA_FP32,
    TORCH_CUDA_BF16,
    TORCH_CUDA_NF4,
    TORCH_CUDA_MERGED_FP32,
    TORCH_CUDA_MERGED_BF16,
    TORCH_CUDA_GRAPHS_FP32,
    TORCH_CUDA_GRAPHS_BF16,
)}
BACKENDS = (*REGISTRY, "auto")  # what IBEDL_BACKEND accepts
# Which backend is fastest depends on the CPU, not only on its flags (benchmarks/results/cpu_backends.json): ``auto``
# measures it at start-up (ibedl.core.auto_backend).
DEFAULT_BACKEND = "auto"
# The model as loaded: what a predictor starts on, the one backend several adapters share, and auto's fallback and
# first champion (every other trunk is built from it).
REFERENCE = TORCH.name


def check_backend(name: str) -> str:
    """``name`` if it is a registered backend or ``auto``, else a ValueError naming it and the choices."""
    if name != "auto" and name not in REGISTRY:
        raise ValueError(f"unknown inference backend {name!r}; choose one of {', '.join([*REGISTRY, 'auto'])}")
    return name


def get(name: str) -> Backend:
    """The backend called ``name`` (ValueError for an unknown name, or for ``auto``: resolve it first)."""
    if check_backend(name) == "auto":
        raise ValueError("auto is a choice among backends, not one: resolve it first (build_trunk)")
    return REGISTRY[name]


def of_key(key: str) -> Backend | None:
    """The registered backend whose arithmetic the calibration key ``key`` names (``torch-fp32``: torch), None for a
    key none of them owns."""
    return next((b for b in REGISTRY.values() if b.owns_key(key)), None)


__all__ = ["REGISTRY", "BACKENDS", "DEFAULT_BACKEND", "REFERENCE", "check_backend", "get", "of_key"]
