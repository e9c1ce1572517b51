"""IB-EDL: calibrated multiple-choice answers from fine-tuned LLMs.

    import ibedl
    model = ibedl.load("artifacts/default")          # or several: ibedl.load("artifacts/default", "artifacts/map")
    model.predict([{"question": "...", "options": ["...", "..."]}])   # -> list[PredictResponse]

The package: ``ibedl.core`` (the shared core), ``ibedl.training``, ``ibedl.engine`` (what both front doors share:
adapters, request checks, answers), ``ibedl.serve`` (the HTTP service), ``ibedl.api`` (the Python API above) and
``ibedl.batch`` (its JSONL command). The API's names are imported from ``ibedl.api`` on first use (PEP 562), so
``import ibedl.core.head`` imports neither the API nor the service.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["load", "Model", "Checked", "EngineError", "PredictResponse"]

if TYPE_CHECKING:
    from ibedl.api import Checked, EngineError, Model, PredictResponse, load


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("ibedl.api"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
