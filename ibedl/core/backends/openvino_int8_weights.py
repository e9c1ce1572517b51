"""The ``openvino`` backend: the IR with int8 weights (asymmetric, one scale per 64 input channels) decompressed inside
the CPU plugin's matmul kernels; activations stay fp32. ``auto`` does not choose it: it serves when named."""

from ibedl.core.backends.openvino_ir import INT8_WEIGHTS, OpenVINOBackend

BACKEND = OpenVINOBackend("openvino", INT8_WEIGHTS, precision="f32", auto=False, build_cost=2)
