"""The documentation: the site builds with ``mkdocs build --strict``, links point at files, the README stays
short, and every setting, config key, CLI flag, route, field, manifest key, metric and alert in the code is
named in its reference page (a test that fails when one is added without docs)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
README_MAX_LINES = 200

# [text](target) and ![alt](target); targets with a scheme (http:, mailto:) or only an anchor are not files.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def page(name: str) -> str:
    return (REFERENCE / name).read_text()


def outside_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


class TestSite:
    def test_mkdocs_build_strict(self, tmp_path):
        # mkdocs and mkdocs-material come with the dev extra (make setup): missing, the build below fails loudly.
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        index = (tmp_path / "site" / "index.html").read_text()
        assert "fonts.googleapis" not in index, "the site must read offline: keep theme.font: false"

    def test_every_page_is_in_the_nav(self):
        nav = (ROOT / "mkdocs.yml").read_text()
        pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
        missing = sorted(p for p in pages if p not in nav)
        assert not missing, f"pages not in mkdocs.yml's nav: {missing}"

    def test_makefile_has_docs_targets(self):
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(r"^docs:", makefile, re.M) and "mkdocs build --strict" in makefile
        assert re.search(r"^docs-serve:", makefile, re.M) and "mkdocs serve" in makefile


class TestReadme:
    def test_short(self):
        lines = (ROOT / "README.md").read_text().count("\n")
        assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; keep it under {README_MAX_LINES} "
                                           "(details go to docs/)")

    def test_names_the_quick_start_and_docs_commands(self):
        text = (ROOT / "README.md").read_text()
        for command in ("make serve", "make test", "make docs", "make docs-serve"):
            assert command in text, command

    def test_no_reference_to_a_missing_design_document(self):
        assert "DESIGN.md" not in (ROOT / "README.md").read_text()


class TestLinks:
    @pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
    def test_relative_links_point_at_files(self, path):
        broken = []
        for target in LINK.findall(outside_code_blocks(path.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(target)
        assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"

    @pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
    def test_python_modules_named_exist(self, path):
        """Every ``python -m pkg.mod`` in the docs is a module of this repository (or a known tool)."""
        external = {"pytest", "mkdocs", "pip", "venv"}
        missing = []
        for module in re.findall(r"python -m ([A-Za-z_][\w.]*)", path.read_text()):
            if module.split(".")[0] in external or any(part.isupper() for part in module.split(".")):
                continue  # another tool, or a placeholder (benchmarks.NAME)
            base = ROOT / module.replace(".", "/")
            if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                missing.append(module)
        assert not missing, f"{path.relative_to(ROOT)} names modules that do not exist: {missing}"

    def test_every_runnable_benchmark_is_in_the_benchmarks_index(self):
        """benchmarks/README.md lists every benchmark a user can run (a module with a ``__main__`` block), with the
        command that writes its result."""
        index = (ROOT / "benchmarks" / "README.md").read_text()
        missing = [p.stem for p in sorted((ROOT / "benchmarks").glob("*.py"))
                   if 'if __name__ == "__main__"' in p.read_text()
                   and not re.search(rf"benchmarks\.{p.stem}\b", index)]
        assert not missing, f"benchmarks/README.md does not list {missing}"


class TestSettingsReference:
    def test_every_setting_is_documented(self):
        from ibedl.serve.settings import Settings

        text = page("settings.md")
        missing = [f"IBEDL_{name.upper()}" for name in Settings.model_fields if f"`IBEDL_{name.upper()}`" not in text]
        assert not missing, f"settings missing from docs/reference/settings.md: {missing}"

    def test_every_environment_variable_the_code_reads_is_documented(self):
        text = page("settings.md")
        names = set()
        for package in ("core", "training", "serve"):
            for source in (ROOT / "ibedl" / package).rglob("*.py"):
                names |= set(re.findall(r"IBEDL_[A-Z][A-Z0-9_]*", source.read_text()))
        missing = sorted(n for n in names if f"`{n}`" not in text)
        assert not missing, f"environment variables missing from docs/reference/settings.md: {missing}"


class TestConfigReference:
    def test_every_config_key_is_documented(self):
        from ibedl.training.config import DataConfig, DataPart, LoraSettings, OptimSettings, TrainConfig

        text = page("config.md")
        keys = list(TrainConfig.model_fields)
        for prefix, cls in (("data.", DataConfig), ("lora.", LoraSettings), ("optim.", OptimSettings)):
            keys += [prefix + name for name in cls.model_fields]
        missing = [k for k in keys if f"`{k}`" not in text]
        missing += [f"part {name}" for name in DataPart.model_fields if f"`{name}`" not in text]
        assert not missing, f"config keys missing from docs/reference/config.md: {missing}"

    def test_every_method_and_its_parameters_are_documented(self):
        from ibedl.training.methods import METHODS

        text = page("config.md")
        missing = [name for name in METHODS if f"`{name}`" not in text]
        for name, method in METHODS.items():
            missing += [f"{name}.{key}" for key in method.defaults
                        if not re.search(rf"^\|[^|]*`{name}`[^|]*\| `{key}` \|", text, re.M)]
        assert not missing, f"methods or method_params missing from docs/reference/config.md: {missing}"


# Every command-line entry point: module, and the argv that prints its help (sub-commands too).
CLIS = [
    ("ibedl.training.finetune", []),
    ("ibedl.training.evaluate", []),
    ("ibedl.training.calibrate", []),
    ("ibedl.training.experiments.benchmark", []),
    ("ibedl.training.confidence_ceiling", []),
    ("ibedl.core.migrate", []),
    ("ibedl.core.model_card", []),
    ("ibedl.core.manifest_schema", []),
    ("ibedl.serve.__main__", []),
    ("ibedl.batch", []),
    ("benchmarks.decisions", ["score"]),
    ("benchmarks.decisions", ["analyse"]),
    ("benchmarks.decisions", ["choose-rate"]),
    ("benchmarks.decisions", ["compare"]),
    ("benchmarks.paired_bootstrap", []),
    ("benchmarks.drift_streams", []),
    ("benchmarks.method_efficiency", []),
    ("benchmarks.laplace_prior", []),
    ("benchmarks.paper_comparison", []),
    ("benchmarks.grid_predictions", []),
    ("benchmarks.grid_intervals", []),
    ("benchmarks.posthoc_repair", []),
    ("benchmarks.device_floor", []),
    ("benchmarks.sigma_replication", []),
]


class TestCliReference:
    @pytest.mark.parametrize(("module", "argv"), CLIS, ids=lambda v: v if isinstance(v, str) else " ".join(v))
    def test_every_flag_is_documented(self, module, argv, monkeypatch):
        monkeypatch.setenv("COLUMNS", "100")
        main = importlib.import_module(module).main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            main([*argv, "--help"])
        assert exit_.value.code == 0
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue())) - {"--help"}
        assert flags, f"no flags found in {module} --help"
        text = page("cli.md")
        missing = sorted(f for f in flags if f not in text)
        assert not missing, f"{module} {' '.join(argv)} flags missing from docs/reference/cli.md: {missing}"


class TestApiReference:
    def test_every_route_is_documented(self, tmp_path):
        from ibedl.serve.app import create_app
        from ibedl.serve.settings import Settings

        app = create_app(Settings(artifact=tmp_path))
        text = page("api.md")
        routes = [(sorted(r.methods - {"HEAD"})[0], r.path) for r in app.routes
                  if getattr(r, "methods", None) and r.include_in_schema]
        routes.append(("GET", "/metrics"))
        missing = [f"{m} {p}" for m, p in routes if f"`{m} {p}`" not in text]
        assert not missing, f"routes missing from docs/reference/api.md: {missing}"

    def test_every_field_is_documented(self):
        from pydantic import BaseModel

        import ibedl.engine.schemas as schemas

        text = page("api.md")
        missing = []
        for name, model in vars(schemas).items():
            if isinstance(model, type) and issubclass(model, BaseModel) and model is not BaseModel:
                missing += [f"{name}.{field}" for field in model.model_fields if f"`{field}`" not in text]
        assert not missing, f"fields missing from docs/reference/api.md: {missing}"


class TestArtifactReference:
    def test_every_manifest_and_head_field_is_documented(self):
        from ibedl.core.artifact import Manifest
        from ibedl.core.head import HeadConfig

        text = page("artifact.md")
        missing = [f"manifest {f.name}" for f in dataclasses.fields(Manifest) if f"`{f.name}`" not in text]
        missing += [f"head {f.name}" for f in dataclasses.fields(HeadConfig) if f"`{f.name}`" not in text]
        assert not missing, f"fields missing from docs/reference/artifact.md: {missing}"


class TestMetricsReference:
    def test_every_prometheus_metric_is_documented(self):
        from ibedl.serve.metrics import Metrics

        text = page("metrics.md")
        names = [family.name for family in Metrics().registry.collect()]
        missing = [n for n in names if not re.search(rf"`{n}(_total|_info)?[`{{]", text)]
        assert not missing, f"metrics missing from docs/reference/metrics.md: {missing}"

    def test_every_evaluation_metric_is_documented(self):
        import numpy as np

        from ibedl.training.metrics import summarise

        keys = summarise(np.array([[0.7, 0.3], [0.4, 0.6]]), np.array([0, 0]), uncertainty=[0.2, 0.5])
        text = page("metrics.md")
        missing = [k for k in keys if f"`{k}`" not in text]
        assert not missing, f"metric keys missing from docs/reference/metrics.md: {missing}"

    def test_every_alert_is_documented(self):
        rules = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
        text = (DOCS / "guides" / "monitor.md").read_text()
        missing = [a for a in re.findall(r"alert:\s*(\w+)", rules) if f"`{a}`" not in text]
        assert not missing, f"alerts missing from docs/guides/monitor.md: {missing}"
