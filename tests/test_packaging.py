"""What ``pip install ibedl`` puts into an environment: the four packages users import (`ibedl`, the Python API, and the three it is built on), nothing else at the top
level (no ``tests``, ``benchmarks``, ``deploy``); the plan for the names is in docs/development.md."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = {"ibedl", "evidential", "training", "service"}


def test_the_wheel_holds_only_the_packages_users_import(tmp_path):
    # Built from a copy that also holds the directories that must stay out, so the repository is left untouched.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for name in (*INSTALLED, "benchmarks", "tests", "deploy"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("ibedl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == INSTALLED, f"the wheel installs {sorted(top)} at the top level"
    assert {"ibedl/__init__.py", "evidential/migrate.py", "training/data/__init__.py", "service/app.py"} <= set(names)
