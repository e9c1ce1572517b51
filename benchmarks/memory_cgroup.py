"""A memory cgroup with a limit, as Kubernetes gives a replica (``resources.limits.memory``): a benchmark starts the
service inside it (``preexec``) and reads what the kernel counted: the peak charge, the anonymous memory (what cannot
be dropped: file pages such as a memory-mapped IR are reclaimed under the limit) and the out-of-memory kills.

cgroup v1 (``/sys/fs/cgroup/memory``) and v2 (``/sys/fs/cgroup`` with ``cgroup.controllers``) both work; creating
one needs a writable cgroup filesystem (root in a container that mounts it so), else OSError saying so.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class MemoryCgroup:
    """A fresh cgroup limited to ``limit_bytes``; ``preexec`` moves a child into it before it runs."""

    def __init__(self, limit_bytes: int, root: Path = ROOT) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.v2 = (root / "cgroup.controllers").is_file()
        base = root if self.v2 else root / "memory"
        if not base.is_dir():
            raise OSError(f"no memory cgroup filesystem at {base}")
        self.path = base / f"ibedl-bench-{uuid.uuid4().hex[:8]}"
        try:
            self.path.mkdir()
            self._write("memory.max" if self.v2 else "memory.limit_in_bytes", str(limit_bytes))
            if self.v2:
                self._write("memory.swap.max", "0")
        except OSError as e:
            raise OSError(f"cannot create a memory cgroup under {base} ({e}): run as root where the cgroup filesystem "
                          "is writable, or without --memory-limit-mib") from e

    def _write(self, name: str, text: str) -> None:
        (self.path / name).write_text(text)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def preexec(self) -> None:
        """In the child before it runs: join the cgroup (its children, the IR builds, join with it)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def anon_bytes(self) -> int:
        """Anonymous memory charged now (v1 ``total_rss``, v2 ``anon``)."""
        key = "anon" if self.v2 else "total_rss"
        for line in self._read("memory.stat").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    def stats(self) -> dict:
        """The limit, the peak charge (file pages included), and the out-of-memory kills so far."""
        if self.v2:
            events = dict(line.split() for line in self._read("memory.events").splitlines())
            peak = int(self._read("memory.peak")) if (self.path / "memory.peak").is_file() else None
            kills = int(events.get("oom_kill", 0))
        else:
            control = dict(line.split() for line in self._read("memory.oom_control").splitlines())
            peak, kills = int(self._read("memory.max_usage_in_bytes")), int(control.get("oom_kill", 0))
        return {"limit_mib": self.limit_bytes / 2**20, "peak_charge_mib": None if peak is None else peak / 2**20,
                "oom_kills": kills, "cgroup": "v2" if self.v2 else "v1"}

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (best effort)."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


__all__ = ["MemoryCgroup"]
