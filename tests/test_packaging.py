"""What ``pip install ibedl`` puts into an environment: one top-level package, ``ibedl`` (``ibedl.core``,
``ibedl.training``, ``ibedl.serve``, the Python API), nothing else at the top level (no ``tests``, ``benchmarks``,
``deploy``); the layout is in docs/development.md#packaging."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = {"ibedl"}


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
    assert {"ibedl/__init__.py", "ibedl/api.py", "ibedl/batch.py", "ibedl/core/migrate.py",
            "ibedl/training/data/__init__.py", "ibedl/serve/app.py", "ibedl/serve/__main__.py"} <= set(names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = dict(line.split(" = ") for line in zipfile.ZipFile(wheel).read(entry_points).decode().splitlines()
                   if " = " in line)
    assert scripts == {"ibedl-finetune": "ibedl.training.finetune:main",
                       "ibedl-evaluate": "ibedl.training.evaluate:main",
                       "ibedl-serve": "ibedl.serve.__main__:main", "ibedl-batch": "ibedl.batch:main"}
