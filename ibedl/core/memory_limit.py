"""The memory a process may use here (its container's cgroup limit) and children that give way first.

A replica runs under a memory limit (Kubernetes: ``resources.limits.memory``, a cgroup). The work ``auto`` does in
the background (exporting an IR, proving that OpenVINO compiles it) runs in child processes that are
:func:`expendable`: at the lowest CPU priority, and the first the kernel's out-of-memory killer picks
(``oom_score_adj`` 1000), so a build that does not fit is killed instead of the service, which stays where it was.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63
_frozen = False  # whether collect_garbage(freeze=True) froze this process's heap (a caller's own freeze is left alone)
_collecting = threading.Lock()  # one collect_garbage at a time: two would undo each other's unfreeze and freeze
# Held while a CUDA graph is captured (ibedl.core.backends.cuda_graphs) and while torch's CUDA cache is emptied: an
# empty_cache on another thread during a capture fails torch's allocator (it asserts that no capture is under way).
CUDA_CACHE = threading.Lock()


def container_limit_bytes(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """This process's memory limit in bytes (cgroup v2 ``memory.max``, else v1 ``memory.limit_in_bytes``, of its own
    cgroup, else of the root of the mount), or None when there is none or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    candidates = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if controllers == "":  # v2's unified hierarchy: "0::/path"
            candidates.append(root / rel / "memory.max")
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / rel / "memory.limit_in_bytes")
    candidates += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    for file in candidates:
        try:
            text = file.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= UNLIMITED else value
    return None


def expendable() -> None:
    """In a child process before it runs (``subprocess.Popen(preexec_fn=expendable)``): the lowest CPU priority and
    the first pick of the out-of-memory killer. Where /proc does not allow it, only the priority changes."""
    os.nice(19)
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")


def collect_garbage(freeze: bool = False) -> None:
    """Collect every unreachable object and hand the memory back (:func:`return_freed_memory`): a dropped model is
    reachable only through its own cycles. ``freeze``: then move what survives out of the cyclic collector's scans
    (``gc.freeze``: the service does once loaded, ibedl.engine.heap); from then on every call collects the frozen
    objects too and freezes what survives again. A heap someone else froze (a caller of the Python API, before it
    forks) is left as it is: its frozen objects are not collected."""
    global _frozen
    with _collecting:
        ours = freeze or _frozen
        if ours:
            gc.unfreeze()
        gc.collect()
        if ours:
            gc.freeze()
            _frozen = True
    return_freed_memory()


def return_freed_memory() -> None:
    """Hand memory freed by Python back to the system (glibc keeps freed heap pages otherwise): after a model or a
    compiled trunk is dropped, the process's resident size shrinks instead of staying at its peak. Where CUDA is in
    use, torch's cached GPU blocks go back to the driver too (a dropped model's, once a CUDA trunk serves)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    torch = sys.modules.get("torch")  # not imported for this alone
    if torch is not None and torch.cuda.is_initialized():
        with CUDA_CACHE:  # never while a CUDA graph is being captured
            torch.cuda.empty_cache()


def killed_reason(signal_name: str, what: str) -> str:
    """Why a child killed by ``signal_name`` probably died, and what to do (SIGKILL: the out-of-memory killer)."""
    if signal_name != "SIGKILL":
        return ""
    limit = container_limit_bytes()
    room = f"the container allows {limit / 2**20:.0f} MiB" if limit is not None else "the machine ran out of memory"
    return (f" (probably out of memory: {room}; {what} ahead of serving, where there is room: "
            "python -m ibedl.core.measure_backends --artifact DIR, as the image does)")


__all__ = ["collect_garbage", "container_limit_bytes", "expendable", "killed_reason", "return_freed_memory",
           "CUDA_CACHE"]
