"""Who may call what: the bearer tokens each path takes (every route but the health probes and the docs' static
assets takes IBEDL_API_TOKEN when one is set, so a new route is protected without being listed; /metrics takes
IBEDL_METRICS_TOKEN; the labelling routes take IBEDL_LABEL_TOKEN alone). The HTTP request guard
(``ibedl.serve.middleware``) and the gRPC door (``ibedl.serve.grpc_door``) both ask here."""

from __future__ import annotations

import secrets

# The health probes (the Open Inference Protocol's too), by exact path: open whatever the tokens, answered over the
# connection cap, not counted in the request metrics. A prefix let any /health/* path past all three.
PROBES = frozenset({"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"})
DOCS_ASSETS = "/docs/assets/"  # the docs pages' scripts and styles: open too
METRICS_PATH = "/metrics"
LABEL_PATHS = ("/v1/feedback", "/v1/feedback/batch")  # labels change what the service reports: their own credential
LABEL_TOKEN, ANONYMOUS = "label_token", "anonymous"  # who sent a label, as the feedback store counts it


def token_ok(expected: str | None, authorization: str) -> bool:
    """Whether an ``Authorization`` header carries the bearer token (always, when none is configured)."""
    if not expected:
        return True
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), expected.encode())


def api_token(settings) -> str | None:
    """The token every route but the public ones takes (IBEDL_API_TOKEN; None: open); the gRPC door's too."""
    return settings.api_token.get_secret_value() if settings.api_token else None


def required_token(settings, path: str) -> str | None:
    """The bearer token ``path`` requires under ``settings`` (None: open)."""
    if path in PROBES or path.startswith(DOCS_ASSETS):
        return None
    if path == METRICS_PATH:
        return settings.metrics_secret()
    return api_token(settings)


def label_access(settings, authorization: str) -> tuple[str | None, tuple[int, str, str] | None]:
    """Who may send labels (to :data:`LABEL_PATHS`): (the credential a request's labels count against, None) when
    it may, (None, (status, type, message)) when not. The labelling credential (IBEDL_LABEL_TOKEN) may; without
    one, anyone may on a loopback service without IBEDL_API_TOKEN (local use), nobody otherwise. A request that
    carries no valid token gets 401; the API token (or none, on an open exposed service) gets 403."""
    label = settings.label_token.get_secret_value() if settings.label_token else None
    if label is not None and token_ok(label, authorization):
        return LABEL_TOKEN, None
    if settings.labels_open():
        return ANONYMOUS, None
    api = settings.api_token.get_secret_value() if settings.api_token else None
    if not token_ok(api, authorization) or (api is None and label is not None):
        return None, (401, "unauthorized", "a valid 'Authorization: Bearer <token>' header is required")
    if label is None:
        return None, (403, "forbidden", "this service accepts no labels: no labelling credential is configured. "
                      "Set IBEDL_LABEL_TOKEN on every replica and send it as the bearer token of /v1/feedback")
    return None, (403, "forbidden", "this token may not send labels: /v1/feedback takes the labelling credential "
                  "(IBEDL_LABEL_TOKEN), not the API token")
