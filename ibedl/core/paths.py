"""Where the shared core keeps and finds files, read from ``IBEDL_*`` variables by a settings class like the
engine's and the service's (ibedl.engine.settings), so every ``IBEDL_*`` variable is read one way: the cache of
converted base models and exported backends (``IBEDL_CACHE_DIR``) and the built-in datasets (``IBEDL_DATA_DIR``).
"""

from __future__ import annotations

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
