"""What the benchmark scripts share: writing their results file, and the CPU each speed figure was measured on."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ibedl.core.cpu_isa import cpu_flags, model_name, onednn_cap

REPO = Path(__file__).resolve().parents[1]  # the repository's root, where the benchmarks run as modules


def write_result(path: str | Path, result, echo: bool = True) -> Path:
    """Write ``result`` as indented JSON to ``path`` (parents created) and print it unless ``echo`` is false."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    path.write_text(text)
    if echo:
        print(text, end="")
    return path


def cpu_features() -> dict:
    """The CPU's model name, the instruction sets the backends' speed depends on, oneDNN's instruction cap when one is
    set (the kernels then run an older CPU's code) and the cores this process may use: recorded with every speed
    figure. Read through :mod:`ibedl.core.cpu_isa`, the one place that parses the CPU."""
    flags = cpu_flags()
    isa = {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model_name(), **isa, "onednn_cap": onednn_cap() or None, "cores": cores}


def voluntary_context_switches(pid: int | str = "self") -> int:
    """How often the threads of process ``pid`` have given up the CPU to wait: ``voluntary_ctxt_switches`` summed over
    ``/proc/<pid>/task/*/status`` (Linux; threads that have exited are not counted). A torch forward whose OpenMP
    workers sleep between parallel regions makes thousands a question, one whose workers spin a handful
    (ibedl.engine.engine.Engine keeps every torch call on one thread for that)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        total += next(int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("voluntary_ctxt_switches:"))
    return total
