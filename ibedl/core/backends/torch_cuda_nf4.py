"""The ``torch-cuda-nf4-bf16`` backend: the base model's linear weights in 4-bit NF4 (bitsandbytes, double
quantisation), computed in bfloat16, with the adapter on CUDA: what ``IBEDL_LOAD_IN_4BIT=true`` serves and
``python -m ibedl.training.calibrate --device cuda --load-in-4bit`` runs. About a quarter of bf16's weight memory."""

from ibedl.core.backends.torch_cuda import TorchCudaBackend

BACKEND = TorchCudaBackend("torch-cuda-nf4-bf16", "bfloat16", load_in_4bit=True)
