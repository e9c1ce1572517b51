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


# Run in a fresh interpreter: a finder first on sys.meta_path refuses the forbidden packages, then the API loads the
# tiny artifact and answers, and the batch command's module imports.
BLOCKED_RUN = """
import importlib.abc, json, sys

BLOCKED = {blocked!r}


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{{name}} is blocked in this test")
        return None


sys.meta_path.insert(0, Refuse())
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
loaded = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
print(json.dumps({{"id": answer.id, "adapter": answer.adapter.name, "refused": refused, "loaded": loaded}}))
"""


def test_the_api_loads_and_answers_without_fastapi_starlette_uvicorn_or_prometheus(tiny_artifact):
    blocked = ["fastapi", "starlette", "uvicorn", "prometheus_client", "ibedl.serve"]
    code = BLOCKED_RUN.format(blocked=blocked, artifact=str(tiny_artifact))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"id": "a", "adapter": "tiny", "refused": ["invalid_request", "items.0.options"], "loaded": []}
