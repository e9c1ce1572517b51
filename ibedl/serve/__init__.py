"""The FastAPI service: POST /predict answers multiple-choice questions with Dirichlet uncertainty,
abstains when unsure, and exposes health, model metadata, drift and Prometheus metrics.

It is one front door of ``ibedl.engine`` (which loads the adapters, checks requests and builds answers; the
Python API, ``ibedl.api``, is the other): it adds HTTP, batching, admission, metrics and drift bookkeeping, and
maps the engine's errors to status codes (``ibedl.serve.errors``). It depends on ``ibedl.engine`` and
``ibedl.core``, never on ``ibedl.training``.
"""
