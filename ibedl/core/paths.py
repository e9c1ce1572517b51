"""Where the shared core keeps and finds files, read from ``IBEDL_*`` variables by a settings class like the
engine's and the service's (ibedl.engine.settings), so every ``IBEDL_*`` variable is read one way: the cache of
converted base models and exported backends (``IBEDL_CACHE_DIR``) and the built-in datasets (``IBEDL_DATA_DIR``);
and whether a path a command will write can be written (:func:`check_writable`), asked before its work.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# <repository>/../shared/data, from this package's location (not the current directory)
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"


class PathSettings(BaseSettings):
    """``IBEDL_CACHE_DIR`` and ``IBEDL_DATA_DIR``; other ``IBEDL_*`` variables are the engine's and service's."""

    model_config = SettingsConfigDict(env_prefix="IBEDL_", extra="ignore")

    cache_dir: Path = Field(Path.home() / ".cache" / "ibedl",
                            description="converted base models and exported backends (backends/)")
    data_dir: str | None = Field(None, description="the built-in datasets (training, evaluation, calibration, "
                                  "benchmarks); default <repository>/../shared/data")


def cache_dir() -> Path:
    """``IBEDL_CACHE_DIR`` (default ``~/.cache/ibedl``)."""
    return PathSettings().cache_dir.expanduser()


def data_dir() -> Path:
    """``IBEDL_DATA_DIR`` (default ``<repository>/../shared/data``)."""
    configured = (PathSettings().data_dir or "").strip()
    return Path(configured).expanduser() if configured else DEFAULT_DATA_DIR


__all__ = ["PathSettings", "cache_dir", "data_dir", "DEFAULT_DATA_DIR"]


def check_writable(path, flag: str, directory: bool = False) -> Path:
    """``path`` (what ``flag`` names) as a Path, once it is known that it can be written: a file (``directory``: a
    folder to write files in) that is not the other kind, under a folder this process can create files in (the
    nearest one that exists: the missing ones are made when it is written). ValueError naming ``flag`` and ``path``
    otherwise, so that a command refuses before its work rather than after it. The folder is probed by creating an
    unnamed file in it: ``os.access`` says yes to root even where nothing can be created (/proc)."""
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        raise ValueError(f"{flag} {path} is a {'file' if directory else 'directory'}: name a "
                         f"{'directory' if directory else 'file'}")
    if path.exists() and not directory and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is a file this process may not write")
    folder = path if directory else path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {folder} ({e.strerror})") from None
    return path
