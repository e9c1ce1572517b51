"""The ``torch-cuda-bf16`` backend: the base model and adapter in bfloat16 on CUDA, what a CUDA service loads by
default and ``python -m ibedl.training.calibrate --device cuda`` runs (GPUs with bfloat16: Ampere and later)."""

from ibedl.core.backends.torch_cuda import TorchCudaBackend

BACKEND = TorchCudaBackend("torch-cuda-bf16", "bfloat16")
