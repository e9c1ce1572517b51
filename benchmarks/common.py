"""What the benchmark scripts share: writing their results file, and the CPU each speed figure was measured on."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def write_result(path: str | Path, result, echo: bool = True) -> Path:
    """Write ``result`` as indented JSON to ``path`` (parents created) and print it unless ``echo`` is false."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    path.write_text(text)
    if echo:
        print(text, end="")
    return path


def cpu_features(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """The CPU's model name and the instruction sets the backends' speed depends on (Linux ``cpuinfo``; without a
    model name there, the platform's processor or machine), and the cores this process may use: recorded with every
    speed figure."""
    cpuinfo = Path(cpuinfo)
    info = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    flags = next((line.split(":")[1].split() for line in info if line.startswith("flags")), [])
    model = next((line.split(":")[1].strip() for line in info if line.startswith("model name")), "")
    isa = {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")}
    return {"model": model or platform.processor() or platform.machine(), **isa,
            "cores": len(os.sched_getaffinity(0))}
