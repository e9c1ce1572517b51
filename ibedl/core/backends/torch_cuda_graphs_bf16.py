"""The ``torch-cuda-graphs-bf16`` backend: the base model in bfloat16 on CUDA with the adapter folded into its weights
(as ``torch-cuda-merged-bf16``), replayed from CUDA graphs, one per padded shape (ibedl.core.backends.cuda_graphs):
an arithmetic of its own, calibrated with ``python -m ibedl.training.calibrate --backend torch-cuda-graphs-bf16
--device cuda``."""

from ibedl.core.backends.torch_cuda import TorchCudaBackend

BACKEND = TorchCudaBackend("torch-cuda-graphs-bf16", "bfloat16", merged=True, graphs=True)
