"""IBEDL_CACHE_DIR and IBEDL_DATA_DIR, read by the core's settings class."""

from pathlib import Path

from ibedl.core import paths
from ibedl.core.base_model import cache_dir
from ibedl.training.data import data_dir


def test_the_cache_and_data_directories_follow_their_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("IBEDL_DATA_DIR", str(tmp_path / "data"))
    assert cache_dir() == tmp_path / "cache" and data_dir() == tmp_path / "data"
    monkeypatch.setenv("IBEDL_CACHE_DIR", "~/somewhere")
    assert cache_dir() == Path.home() / "somewhere"


def test_their_defaults(monkeypatch):
    monkeypatch.delenv("IBEDL_CACHE_DIR", raising=False)
    monkeypatch.delenv("IBEDL_DATA_DIR", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "ibedl"
    assert data_dir() == paths.DEFAULT_DATA_DIR == Path(paths.__file__).resolve().parents[3] / "shared" / "data"
    monkeypatch.setenv("IBEDL_DATA_DIR", "  ")  # blank: the default
    assert data_dir() == paths.DEFAULT_DATA_DIR


def test_no_ibedl_variable_is_read_outside_a_settings_class():
    """One settings story: IBEDL_* variables are read by the settings classes (core paths, engine, service) only."""
    import re

    raw = re.compile(r"""(os\.environ(\.get)?\s*[\[(]|os\.getenv\s*\()\s*["']IBEDL_""")
    package = Path(paths.__file__).resolve().parents[1]
    found = [f"{p.relative_to(package.parent)}:{i}" for p in sorted(package.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if raw.search(line)]
    assert found == []
    assert raw.search('x = os.environ.get("IBEDL_CACHE_DIR")') and raw.search("os.environ['IBEDL_X']")
