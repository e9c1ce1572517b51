"""The engine's import boundary: the engine, the core and the Python API (``ibedl.api``, ``ibedl.batch``) never
import the HTTP service (``ibedl.serve``) nor a web framework; checked in the source (every import statement,
those inside functions too) and at run time (the API loads and answers with those packages unimportable)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("ibedl.serve", "fastapi", "starlette", "uvicorn", "prometheus_client")


def engine_side_files() -> list[Path]:
    return sorted([*(REPO / "ibedl" / "engine").rglob("*.py"), *(REPO / "ibedl" / "core").rglob("*.py"),
                   REPO / "ibedl" / "api.py", REPO / "ibedl" / "batch.py", REPO / "ibedl" / "__init__.py"])


def imported_names(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names (absolute imports; relative ones stay in the package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_engine_core_and_api_import_neither_the_service_nor_a_web_framework():
    files = engine_side_files()
    assert len(files) > 20 and REPO / "ibedl" / "engine" / "runtime.py" in files
    bad = {str(p.relative_to(REPO)): sorted(n for n in imported_names(p) if forbidden(n)) for p in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_checker_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from ibedl.serve import errors\n    import fastapi.responses\n")
    assert sorted(n for n in imported_names(source) if forbidden(n)) == [
        "fastapi.responses", "ibedl.serve", "ibedl.serve.errors"]


# Run in a fresh interpreter: the blocked packages are made unimportable (as if not installed), then the API loads the
# tiny artifact and answers, and the batch command's module imports.
BLOCKED_RUN = """
import json, sys

BLOCKED = {blocked!r}

# As if not installed: ``import`` raises ModuleNotFoundError and importlib.util.find_spec returns None (what
# libraries probe optional packages with); a submodule cannot be imported under its blocked parent.
for name in BLOCKED:
    sys.modules[name] = None
for name in BLOCKED:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"the blocker let {{name}} through")

import ibedl
import ibedl.batch

model = ibedl.load({artifact!r}, max_tokens=96)
(answer,) = model.predict([{{"question": "Which is sun?", "options": ["sun", "moon", "tree"], "id": "a"}}])
try:
    model.predict([{{"question": "q", "options": ["only one"]}}])
except ibedl.EngineError as e:
    refused = [e.type, e.field]
loaded = sorted(m for m, module in sys.modules.items()
                if module is not None and any(m == b or m.startswith(b + ".") for b in BLOCKED))
print(json.dumps({{"id": answer.id, "adapter": answer.adapter.name, "refused": refused, "loaded": loaded}}))
"""


def test_the_api_loads_and_answers_without_fastapi_starlette_uvicorn_or_prometheus(tiny_artifact):
    blocked = ["fastapi", "starlette", "uvicorn", "prometheus_client", "ibedl.serve"]
    code = BLOCKED_RUN.format(blocked=blocked, artifact=str(tiny_artifact))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"id": "a", "adapter": "tiny", "refused": ["invalid_request", "items.0.options"], "loaded": []}


def base_requirements() -> set[str]:
    """The distributions ``pip install ibedl`` (no extras) brings: pyproject's dependencies and, recursively, theirs
    (markers evaluated here, extras left out), as installed in this environment."""
    import importlib.metadata

    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo = [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
        except importlib.metadata.PackageNotFoundError:
            continue
    return seen


def test_the_base_install_loads_an_artifact_and_answers(tiny_artifact):
    """What ``pip install .`` without extras can do: every installed package outside the base requirements is made
    unimportable (the extras: the web stack, OpenVINO, NNCF, psycopg, matplotlib, ...), then ``ibedl.load`` loads
    the tiny artifact (``auto`` falls back to torch) and answers."""
    import importlib.metadata

    from packaging.utils import canonicalize_name

    base = base_requirements()
    assert {"torch", "transformers", "peft", "pydantic", "pydantic-settings"} <= base
    own = {"ibedl", "tests", "benchmarks", "deploy"}
    blocked = sorted(module for module, dists in importlib.metadata.packages_distributions().items()
                     if module.isidentifier() and module not in own and not module.startswith("_")
                     and not any(canonicalize_name(d) in base for d in dists))
    assert {"fastapi", "openvino", "nncf", "psycopg"} <= set(blocked)
    code = BLOCKED_RUN.format(blocked=blocked, artifact=str(tiny_artifact))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"id": "a", "adapter": "tiny", "refused": ["invalid_request", "items.0.options"], "loaded": []}
