"""IBEDL_CACHE_DIR and IBEDL_DATA_DIR, read by the core's settings class."""

import re
from pathlib import Path

import pytest

from ibedl.core import paths
from ibedl.core.base_model import cache_dir
from ibedl.core.paths import check_writable
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


class TestCheckWritable:
    def test_a_file_in_a_folder_yet_to_be_made(self, tmp_path):
        path = tmp_path / "a" / "b" / "m.json"
        assert check_writable(path, "--output") == path and not (tmp_path / "a").exists()  # nothing is made

    def test_a_directory_is_refused_where_a_file_is_asked_and_the_reverse(self, tmp_path):
        (tmp_path / "f").write_text("")
        with pytest.raises(ValueError, match=r"--x .* is a directory: name a file"):
            check_writable(tmp_path, "--x")
        with pytest.raises(ValueError, match=r"--x .*f is a file: name a directory"):
            check_writable(tmp_path / "f", "--x", directory=True)
        assert check_writable(tmp_path, "--x", directory=True) == tmp_path

    def test_a_folder_no_file_can_be_created_in(self, tmp_path, monkeypatch):
        import tempfile

        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "TemporaryFile", refused)  # how a read-only folder answers, even to root
        where = re.escape(f"--x {tmp_path / 'm.json'}: cannot write in {tmp_path} (Permission denied)")
        with pytest.raises(ValueError, match=where):
            check_writable(tmp_path / "m.json", "--x")
