"""The instruction sets this CPU runs OpenVINO's kernels on, as far as they change the numbers: the class of its int8
matrix products (exact int32 dot products with VNNI or AMX; pairs of u8 x s8 products summed in saturating 16-bit
lanes with only AVX2 or AVX512BW) and whether it has native bfloat16. oneDNN's instruction cap
(``ONEDNN_MAX_CPU_ISA``, which OpenVINO's CPU plugin obeys) is counted: it makes this CPU run an older one's kernels,
which is how the tests reproduce an AVX2-only CPU on a newer one.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# CPU flag -> int8 instruction-set class, best first: the class of a CPU is its first flag found here.
INT8_ISAS = (("amx_int8", "amx-int8"), ("avx512_vnni", "avx512-vnni"), ("avx_vnni", "avx-vnni"),
             ("avx512bw", "avx512bw"), ("avx2", "avx2"))
# oneDNN's cap -> the flags of INT8_ISAS it leaves usable (caps not listed leave all of them: DEFAULT, *_AMX_*).
_CAPS = {"sse41": (), "avx": (), "avx2": ("avx2",), "avx2_vnni": ("avx2", "avx_vnni"),
         "avx2_vnni_2": ("avx2", "avx_vnni"), "avx512_core": ("avx2", "avx_vnni", "avx512bw"),
         "avx512_core_vnni": ("avx2", "avx_vnni", "avx512bw", "avx512_vnni")}
_CAPS_WITHOUT_BF16 = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni")


def cpu_flags() -> set[str]:
    """This CPU's flags (Linux /proc/cpuinfo; empty elsewhere), read once per process."""
    return set(_flags())


@functools.lru_cache(maxsize=1)
def _flags() -> frozenset[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in info.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def onednn_cap() -> str:
    """oneDNN's instruction cap from the environment (``ONEDNN_MAX_CPU_ISA``, else ``DNNL_MAX_CPU_ISA``), lower
    case; empty when none is set."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().lower()


def int8_isa(flags: set[str] | None = None, cap: str | None = None) -> str:
    """The instruction-set class a static int8 trunk runs its matrix products on here (``amx-int8``,
    ``avx512-vnni``, ``avx-vnni``, ``avx512bw``, ``avx2``; ``other-<machine>`` otherwise). ``flags``: the CPU's
    flags (default: this machine's); ``cap``: oneDNN's instruction cap (default: :func:`onednn_cap`)."""
    flags = cpu_flags() if flags is None else flags
    cap = onednn_cap() if cap is None else cap.strip().lower()
    if cap in _CAPS:
        flags = flags & set(_CAPS[cap])
    elif cap.startswith("avx512_core_") and "amx" not in cap:  # _bf16, _fp16: VNNI, no AMX
        flags = flags & set(_CAPS["avx512_core_vnni"])
    for flag, name in INT8_ISAS:
        if flag in flags:
            return name
    return f"other-{platform.machine() or 'unknown'}"


def capped_without_bf16() -> bool:
    """Whether oneDNN's cap rules out bfloat16 kernels, whatever the CPU has."""
    return onednn_cap() in _CAPS_WITHOUT_BF16


def bf16_flags(flags: set[str] | None = None) -> bool:
    """Whether the CPU's flags (default: this machine's) include native bfloat16 (AVX512-BF16 or AMX-BF16) and
    oneDNN's cap leaves it usable. (What OpenVINO itself reports: ibedl.core.backends.native_bf16.)"""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and not capped_without_bf16()


def bf16_isa(flags: set[str] | None = None, cap: str | None = None) -> str | None:
    """The instruction-set class this CPU's bfloat16 matrix products run on (``amx-bf16``, ``avx512-bf16``), None
    without native bfloat16. The two round differently: on the default adapter's SciQ questions an AMX machine's
    openvino-bf16 alphas moved up to 8% from an AVX512-BF16 machine's (the same machine capped to AVX512_CORE_BF16:
    0.15%), about half the gap between bf16 and fp32 that gives bf16 a calibration of its own. ``flags``: the CPU's
    (default: this machine's); ``cap``: oneDNN's instruction cap (default: :func:`onednn_cap`)."""
    flags = cpu_flags() if flags is None else flags
    cap = onednn_cap() if cap is None else cap.strip().lower()
    if cap in _CAPS_WITHOUT_BF16:
        return None
    if "amx_bf16" in flags and (not cap or "amx" in cap or cap == "default"):
        return "amx-bf16"
    return "avx512-bf16" if "avx512_bf16" in flags else None


def model_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (Linux), else the machine's count (a
    container's CPU quota is not read)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_signature() -> str:
    """The CPU's model name and flags (Linux), else what ``platform`` knows, and oneDNN's instruction cap when one
    is set (:func:`onednn_cap`: the kernels, so the timings, are another CPU's): what a measurement or a compile
    proof made on this CPU is keyed by (ibedl.core.auto_backend, ibedl.core.backends.openvino_ir)."""
    cap = [f"ONEDNN_MAX_CPU_ISA={onednn_cap()}"] if onednn_cap() else []
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return " | ".join([f"{platform.machine()} {platform.processor()}", *cap])
    lines = [line.split(":", 1)[1].strip() for line in info.splitlines()
             if line.startswith(("model name", "flags")) and ":" in line]
    return " | ".join([*dict.fromkeys(lines), *cap])


def describe() -> str:
    """One line naming this CPU's kind as far as it changes the project's numbers and tests: model, cores, int8 class,
    native bf16, AVX-512, oneDNN's cap. Printed by CI (``python -m ibedl.core.cpu_isa``) and in pytest's header."""
    flags = cpu_flags()
    cap = onednn_cap()
    return (f"{model_name()}, {os.cpu_count()} cores: int8 class {int8_isa()}, "
            f"native bf16 {'yes' if bf16_flags() else 'no'}, avx512f {'yes' if 'avx512f' in flags else 'no'}, "
            f"oneDNN cap {cap or 'none'}")


def describe_device(device) -> str:
    """The machine a run's arithmetic (so its speed) is measured on: for ``cpu`` this CPU's :func:`describe` line; for
    ``cuda``/``cuda:<i>`` the device's name and torch's CUDA version on this host; for another accelerator (``mps``,
    ``xpu``) its name on this host. ``device``: a string or a ``torch.device``. Recorded beside every speed figure."""
    name = str(device) if device is not None else ""
    if not name or name != name.strip():
        raise ValueError(f"device must be such as 'cpu' or 'cuda:0', got {device!r}")
    if name == "cpu":
        return describe()
    if name.startswith("cuda"):
        import torch  # only here: the rest of this module runs before the venv exists

        return f"{torch.cuda.get_device_name(name)} (CUDA {torch.version.cuda}) on host {describe()}"
    return f"{name} on host {describe()}"


__all__ = ["INT8_ISAS", "cpu_flags", "onednn_cap", "int8_isa", "capped_without_bf16", "bf16_flags", "bf16_isa",
           "model_name",
           "cpu_signature", "describe", "describe_device"]


if __name__ == "__main__":
    print(f"cpu: {describe()}")
