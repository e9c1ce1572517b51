"""The ``openvino-bf16`` backend: the fp32 IR (exported once for both) run with bfloat16 matmuls (fp32 accumulation) on
CPUs with native bf16 instructions (AVX512-BF16, AMX); on 96 SciQ validation questions it served 2.6x torch's
batch-8 throughput with torch's answers and max |p - p_torch| 0.030. Its build is fp32's export, then a bf16
compile."""

from ibedl.core.backends.openvino_ir import FP32, OpenVINOBackend

BACKEND = OpenVINOBackend("openvino-bf16", FP32, precision="bf16", auto=True, build_cost=2)
