"""Write the entries of a hashed lock file without torch and the CUDA runtime it brings (nvidia-*, cuda-*,
triton): the pool a CUDA machine that already has its torch is given wheels from, offline (make gpu-wheels,
requirements/offline.py).

    python requirements/without_cuda.py .venv-lock/gpu-runtime.txt > requirements/gpu-offline.txt

Each entry keeps its ``--hash`` lines and its ``# via`` annotation (what it is there for: requirements/offline.py
follows them); other comments are dropped. Standard library only (it runs before any venv)."""

from __future__ import annotations

import re
import sys

CUDA = re.compile(r"^(torch|triton|nvidia-[\w.-]+|cuda-[\w.-]+)==", re.IGNORECASE)
HEADER = ("# What the project needs at run time on a CUDA machine (pyproject's dependencies, the train, serve and\n"
          "# gpu extras, requirements/gpu.in) at requirements/gpu.lock.txt's versions, without torch and its CUDA\n"
          "# runtime: the pool make gpu-wheels picks from (requirements/offline.py). Written by make lock\n"
          "# (requirements/without_cuda.py).\n")


def without_cuda(text: str) -> str:
    """``text`` (name==version entries with indented --hash continuation lines and ``# via`` annotations, as uv
    writes them) minus the CUDA entries; the file's own comments dropped."""
    out, keep = [HEADER], False
    for line in text.splitlines():
        if not line.strip() or not line[0].isspace() and line.startswith("#"):
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
