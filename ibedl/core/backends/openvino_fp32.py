"""The ``openvino-fp32`` backend: the LoRA-merged trunk converted once to OpenVINO IR, run in fp32."""

from ibedl.core.backends.openvino_ir import FP32, OpenVINOBackend

BACKEND = OpenVINOBackend("openvino-fp32", FP32, precision="f32", auto=True, build_cost=1)
