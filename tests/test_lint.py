"""The code passes ``ruff check`` with the rules in pyproject.toml ([tool.ruff]: pycodestyle errors with lines
up to 120 characters, and pyflakes). No formatter: ``ruff format`` would rewrite most files' hand-wrapped lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check():
    # ruff comes with the dev extra (make setup): missing, this fails loudly rather than skipping.
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
