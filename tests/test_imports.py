"""The package's import graph, read from the source (every import, at module level or inside a function): the core
imports nothing above it, the engine nothing from the web layer or training, and no module reaches itself again."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ibedl"


def modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def graph() -> dict[str, set[str]]:
    """module -> the ibedl modules it imports (``from a.b import c`` counts module a.b.c when it is one)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ibedl"):
                found |= {resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names if a.name.startswith("ibedl")}
        edges[name] = found - {name, None}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_core_imports_nothing_above_it():
    bad = sorted((m, t) for m, ts in graph().items() if m.startswith("ibedl.core") for t in ts
                 if not t.startswith("ibedl.core") and t != "ibedl")
    assert bad == []


def test_the_engine_imports_neither_the_web_layer_nor_training():
    bad = sorted((m, t) for m, ts in graph().items() if m.startswith("ibedl.engine") for t in ts
                 if t.startswith(("ibedl.serve", "ibedl.training")))
    assert bad == []


def test_the_doors_import_only_the_engines_public_surface():
    """ibedl.serve (HTTP v1, the Open Inference Protocol over REST and gRPC) reaches the engine through
    ibedl.engine.PUBLIC only, and the core only for its vocabulary (option letters, the conformal levels' keys)."""
    from ibedl.engine import PUBLIC

    vocabulary = ("ibedl.core.prompt", "ibedl.core.conformal")
    edges = graph()
    bad = sorted((m, t) for m, ts in edges.items() if m.startswith("ibedl.serve") for t in ts
                 if t.startswith("ibedl.") and not t.startswith("ibedl.serve") and t not in PUBLIC + vocabulary)
    assert bad == []
    assert "ibedl.engine.engine" in edges["ibedl.serve.state"]  # the reader sees the doors' imports


# What a door may not touch on an engine: its scheduler, runtime replacements, feedback store, admission policy and
# state, and anything private; it calls the engine's methods (arrive, refuse_early, ask, drain, health, ...).
ENGINE_INTERNALS = {"batcher", "versions", "feedback", "store", "admission", "status", "reason", "observers"}


def engine_reach(path: Path) -> list[str]:
    """``engine.<name>`` attribute uses in ``path`` that reach into the engine (ENGINE_INTERNALS or private)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if owner == "engine" and (node.attr in ENGINE_INTERNALS or node.attr.startswith("_")):
                found.append(f"{path.name}:{node.lineno} engine.{node.attr}")
    return found


def test_the_doors_call_the_engine_without_reaching_into_it(tmp_path):
    serve = sorted((PACKAGE / "serve").glob("*.py"))
    assert [hit for path in serve for hit in engine_reach(path)] == []
    probe = tmp_path / "door.py"  # the reader is not blind
    probe.write_text("def f(state):\n    state.engine.batcher.depth\n    engine._loop\n    state.engine.ask\n")
    assert sorted(engine_reach(probe)) == ["door.py:2 engine.batcher", "door.py:3 engine._loop"]


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_checks_see_a_cycle_and_a_core_import():
    """The graph reader is not blind: a module importing itself through another, and the core reaching up."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = graph()
    assert "ibedl.core.head" in edges["ibedl.core.predictor"]  # function- and module-level imports are both read
    assert "ibedl.training.methods" in edges["ibedl.training.config"]  # a function-level one
