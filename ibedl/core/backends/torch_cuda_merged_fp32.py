"""The ``torch-cuda-merged-fp32`` backend: the base model in float32 on CUDA with the adapter folded into its
weights (ibedl.core.backends.torch_cuda): half the operations a forward of ``torch-cuda-fp32`` dispatches, in an
arithmetic of its own, calibrated with ``python -m ibedl.training.calibrate --backend torch-cuda-merged-fp32
--device cuda``."""

from ibedl.core.backends.torch_cuda import TorchCudaBackend

BACKEND = TorchCudaBackend("torch-cuda-merged-fp32", "float32", merged=True)
