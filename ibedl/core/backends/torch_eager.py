"""The ``torch`` backend: the PEFT model as loaded (fp32 eager on the CPU; the loaded dtype, or NF4, on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class TorchBackend:
    name: str = "torch"
    precision: str = "model"  # the loaded model's dtype
    auto: bool = True  # the reference auto times the others against, and its fallback
    build_cost: int = 0  # nothing to build: the model as loaded
    static_int8: bool = False

    def calibration_key(self, device="cpu", dtype="float32", load_in_4bit: bool = False) -> str:
        """``torch-<precision>`` on the CPU, ``torch-cuda-[nf4-]<precision>`` on CUDA; ``dtype``: a torch dtype or its
        name."""
        name = str(dtype).removeprefix("torch.")
        if name not in SHORT_DTYPES:
            raise ValueError(f"no calibration key for dtype {dtype!r}; expected one of {sorted(SHORT_DTYPES)}")
        on_cuda = str(device).startswith("cuda")
        return "-".join(["torch", *(["cuda"] if on_cuda else []), *(["nf4"] if load_in_4bit else []),
                         SHORT_DTYPES[name]])

    def owns_key(self, key: str) -> bool:
        """The keys :meth:`calibration_key` gives, ``torch-<precision>`` and ``torch-cuda-[nf4-]<precision>``: not a
        merged CUDA trunk's (``torch-cuda-merged-*``), which the model as loaded does not compute."""
        return key in {self.calibration_key(device, dtype, four_bit) for device in ("cpu", "cuda")
                       for dtype in SHORT_DTYPES for four_bit in (False, True)}

    def unavailable(self, predictor, artifact: Path) -> str | None:
        return None  # runs wherever the model loaded

    def build(self, predictor, artifact: Path, base_sha256: str, export: bool = True):
        return None  # the predictor's own forward

    def export(self, predictor, artifact: Path, base_sha256: str, copy_model: bool = True) -> Path:
        raise ValueError("backend 'torch' runs the model as loaded: there is nothing to export")

    def quantized_on(self, artifact: Path) -> str | None:
        return None


BACKEND = TorchBackend()
