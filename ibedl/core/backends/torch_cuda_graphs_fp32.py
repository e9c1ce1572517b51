"""The ``torch-cuda-graphs-fp32`` backend: the base model in float32 on CUDA with the adapter folded into its weights
(as ``torch-cuda-merged-fp32``), replayed from CUDA graphs, one per padded shape (ibedl.core.backends.cuda_graphs):
an arithmetic of its own, calibrated with ``python -m ibedl.training.calibrate --backend torch-cuda-graphs-fp32
--device cuda``."""

from ibedl.core.backends.torch_cuda import TorchCudaBackend

BACKEND = TorchCudaBackend("torch-cuda-graphs-fp32", "float32", merged=True, graphs=True)
