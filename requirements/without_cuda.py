"""Write the entries of a hashed lock file without torch and the CUDA runtime it brings (nvidia-*, cuda-*,
triton): what a machine that already has a CUDA torch installs from a wheelhouse, offline (make setup-gpu-offline).

    python requirements/without_cuda.py requirements/gpu.lock.txt > requirements/gpu-offline.txt

Each entry keeps its ``--hash`` lines; comments are dropped. Standard library only (it runs before any venv)."""

from __future__ import annotations

import re
import sys

CUDA = re.compile(r"^(torch|triton|nvidia-[\w.-]+|cuda-[\w.-]+)==", re.IGNORECASE)
HEADER = ("# requirements/gpu.lock.txt without torch and its CUDA runtime: what make setup-gpu-offline installs\n"
          "# beside the CUDA torch a machine already has. Written by make lock (requirements/without_cuda.py).\n")


def without_cuda(text: str) -> str:
    """``text`` (name==version entries with indented --hash continuation lines) minus the CUDA entries."""
    out, keep = [HEADER], False
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            keep = CUDA.match(line) is None
        if keep:
            out.append(line + "\n")
    return "".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python requirements/without_cuda.py LOCK_FILE > OUTPUT")
    with open(sys.argv[1], encoding="utf-8") as lock:
        sys.stdout.write(without_cuda(lock.read()))
