"""The ``torch-cuda-merged-bf16`` backend: the base model in bfloat16 on CUDA with the adapter folded into its
weights (ibedl.core.backends.torch_cuda): half the operations a forward of ``torch-cuda-bf16`` dispatches, in an
arithmetic of its own, calibrated with ``python -m ibedl.training.calibrate --backend torch-cuda-merged-bf16
--device cuda``."""

from ibedl.core.backends.torch_cuda import TorchCudaBackend

BACKEND = TorchCudaBackend("torch-cuda-merged-bf16", "bfloat16", merged=True)
