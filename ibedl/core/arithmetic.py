"""Whether a calibration's numbers are the ones this CPU computes: a backend whose arithmetic differs between CPU
kinds records, in its calibration, the class it ran on, and a calibration made on another class does not hold here.

- static int8 (``openvino-int8``): the questions its trunk was quantised on and the int8 instruction set
  (:mod:`ibedl.core.quantization_sample`);
- bfloat16 on the CPU (``openvino-bf16``): the bf16 instruction set (``calibration.bf16.isa``:
  :func:`ibedl.core.cpu_isa.bf16_isa`, AMX or AVX512-BF16, which round differently). A calibration that does not
  record it (made before it was recorded) is taken as it is: its outputs' machine is not known.

Every other backend computes the same numbers on every CPU up to float rounding (fp32: within 3e-5 of the
probabilities between an AVX2-capped and an AVX-512 run of the default, a helper's measurement).
"""

from __future__ import annotations

from ibedl.core import quantization_sample
from ibedl.core.cpu_isa import bf16_isa


def cpu_bf16(backend) -> bool:
    """Whether ``backend`` (a registry entry) computes in bfloat16 on the CPU (OpenVINO's bf16 precision)."""
    return getattr(backend, "precision", None) == "bf16" and hasattr(backend, "ir")


def depends(backend) -> bool:
    """Whether ``backend``'s numbers depend on the CPU's class (its calibration records which: static int8, CPU
    bfloat16)."""
    return bool(backend is not None and (backend.static_int8 or cpu_bf16(backend)))


def mismatch(backend, record: dict, sample_sha256: str | None) -> str | None:
    """Why the calibration whose ``calibration`` record is ``record`` does not hold for ``backend`` on this CPU (the
    artifact's quantisation sample's sha256: ``sample_sha256``), or None when it does."""
    if backend.static_int8:
        return quantization_sample.mismatch(record, sample_sha256)
    if cpu_bf16(backend):
        made_on, here = (record.get("bf16") or {}).get("isa"), bf16_isa()
        if made_on is not None and made_on != here:
            return (f"the calibration was made on bfloat16 arithmetic of another instruction set ({made_on}; this CPU "
                    f"runs {here or 'no native bfloat16'})")
    return None


def made_on(backend) -> dict:
    """What a calibration made here on ``backend`` records of this CPU's arithmetic ({} for a backend whose numbers
    do not depend on it; static int8's is :func:`ibedl.training.calibrate.quantization_record`)."""
    return {"bf16": {"isa": bf16_isa()}} if cpu_bf16(backend) else {}


__all__ = ["cpu_bf16", "depends", "mismatch", "made_on"]
