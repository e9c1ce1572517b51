"""The ``torch-cuda-fp32`` backend: the base model and adapter in float32 on CUDA (TF32 matmuls where torch allows
them), what ``python -m ibedl.training.calibrate --device cuda --dtype float32`` runs."""

from ibedl.core.backends.torch_cuda import TorchCudaBackend

BACKEND = TorchCudaBackend("torch-cuda-fp32", "float32")
