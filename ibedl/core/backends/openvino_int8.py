"""The ``openvino-int8`` backend: static int8 (weights and activations) by NNCF post-training quantisation on the
artifact's quantisation sample (ibedl.core.quantization_sample); its calibration must record that sample."""

from ibedl.core.backends.openvino_ir import STATIC_INT8, OpenVINOBackend

BACKEND = OpenVINOBackend("openvino-int8", STATIC_INT8, precision="f32", auto=True, build_cost=3)
