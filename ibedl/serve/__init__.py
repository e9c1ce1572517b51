"""The FastAPI service: POST /predict answers multiple-choice questions with Dirichlet uncertainty,
abstains when unsure, and exposes health, model metadata, drift and Prometheus metrics.

It is a front door of one ``ibedl.engine.engine.Engine`` (which loads the adapters, checks requests, schedules them
with admission and batching, builds answers and records feedback; the Python API, ``ibedl.api``, and the Open
Inference Protocol, ``ibedl.serve.oip``, are the others): it adds HTTP, credentials, metrics and drift bookkeeping,
and maps the engine's errors to status codes (``ibedl.serve.errors``). It depends on ``ibedl.engine`` and
``ibedl.core``, never on ``ibedl.training``.
"""
