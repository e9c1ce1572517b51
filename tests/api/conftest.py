"""Python API fixtures: the service tests' app factory (to compare the API with the HTTP answers)."""

from tests.serve.conftest import make_client  # noqa: F401
