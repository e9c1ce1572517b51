"""The FastAPI service: POST /predict answers multiple-choice questions with Dirichlet uncertainty,
abstains when unsure, and exposes health, model metadata, drift and Prometheus metrics.

It depends on ``ibedl.core`` only, never on ``ibedl.training``.
"""
