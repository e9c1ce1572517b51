"""The OpenAPI contract of one app: the statuses each route answers, and the limits this app enforces (its
settings, the loaded adapter's option rows and stored prediction sets) written into the request schemas that
the pydantic models give, so a request the schema admits is one the app accepts, and the other way round."""

from __future__ import annotations

import copy

from fastapi import FastAPI

from ibedl.core.conformal import alpha_key
from ibedl.core.prompt import LETTERS
from ibedl.engine.requests import NOT_BLANK, max_options
from ibedl.engine.schemas import ErrorResponse
from ibedl.serve.state import ServiceState

RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                               "schema": {"type": "integer", "minimum": 1}}}


def _error(description: str, headers: dict | None = None) -> dict:
    return {"model": ErrorResponse, "description": description, **({"headers": headers} if headers else {})}


# Every status a route of this service answers besides 200, with the error types behind it (404 and 405 belong to
# no route, but for the feedback routes' 404). The routes pick theirs from here: API_ERRORS, PREDICT_ERRORS,
# FEEDBACK_ERRORS.
STATUSES = {
    400: _error("`invalid_body`: the body is not UTF-8 text"),
    401: _error("`unauthorized`: `IBEDL_API_TOKEN` is set and the bearer token is missing or wrong (on the labelling "
                "routes: neither the labelling credential nor the API token)",
                {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}}),
    408: _error("`request_timeout`: the body did not arrive within the server's body-read timeout"),
    413: _error("`too_large`: over a limit: the characters of a field (the schema's maxLength), the prompt's "
                "tokens after formatting (`IBEDL_MAX_TOKENS`), the body's bytes (`IBEDL_MAX_BODY_BYTES`), the "
                "items of a batch (maxItems), or the prompt tokens of all a request's questions "
                "(`IBEDL_MAX_REQUEST_TOKENS`); the message names it"),
    403: _error("`forbidden`: a labelling route (`/v1/feedback`, `/v1/feedback/batch`) called with a credential "
                "that may not send labels (the API token), or while no labelling credential (`IBEDL_LABEL_TOKEN`) "
                "is configured; nothing is recorded"),
    404: _error("`feedback_disabled`: the service has no receipt key (`IBEDL_FEEDBACK_KEY`), so feedback is off"),
    409: _error("`adapter_not_served`: the receipt is of an adapter version that is no longer served; "
                "`label_conflict`: the receipt was recorded before with another label (a receipt keeps its first "
                "label; counted in `ibedl_feedback_conflicts_total`)"),
    410: _error("`receipt_expired`: the receipt is older than `IBEDL_FEEDBACK_TTL_S`"),
    415: _error("`unsupported_media_type`: the body is not `application/json`"),
    422: _error("`invalid_request`: the input breaks the schema or a rule it states (the `field` names where); "
                "`invalid_json`: the body is not JSON; `invalid_receipt`: a receipt this service did not sign "
                "(unknown, tampered with, another key's)"),
    429: _error("`too_many_labels`: the labelling credential recorded `IBEDL_MAX_LABELS` labels in the last "
                "`IBEDL_LABEL_WINDOW_S` seconds (all replicas together); retry after `Retry-After` seconds",
                RETRY_AFTER),
    500: _error("`internal_error`: a bug; the service log has the traceback. `model_error`: the model's numbers for a "
                "question were not finite: never an answer (the same question gives the same numbers)"),
    503: _error("`not_ready` (loading, broken or draining), `overloaded` (no answer possible before the "
                "request's deadline), `shutting_down`, or more connections than `IBEDL_MAX_CONNECTIONS`: a refusal "
                "before the model saw the request; `store_unavailable`: the feedback store did not answer within "
                "its timeout (`IBEDL_FEEDBACK_TIMEOUT_S`; a label may have been recorded all the same, and sent "
                "again is a duplicate). Retry after `Retry-After` seconds, on another replica behind a gateway (the "
                "gateway does it once)", RETRY_AFTER),
    504: _error("`timeout`: no answer before the request's deadline (`IBEDL_REQUEST_TIMEOUT_S`, or the "
                "`X-Request-Timeout` the client sent)"),
}
API_ERRORS = {code: STATUSES[code] for code in (401, 500, 503)}
DRIFT_ERRORS = {code: STATUSES[code] for code in (401, 422, 500, 503)}  # 422: ?adapter= names none served
PREDICT_ERRORS = {code: STATUSES[code] for code in (400, 401, 408, 413, 415, 422, 500, 503, 504)}
FEEDBACK_ERRORS = {code: STATUSES[code] for code in (400, 401, 403, 404, 408, 409, 410, 413, 415, 422, 429, 500,
                                                     503)}
GUARANTEES_ERRORS = {code: STATUSES[code] for code in (401, 404, 422, 500, 503)}  # 422: ?adapter= names none

TIMEOUT_HEADER = {
    "name": "X-Request-Timeout",
    "in": "header",
    "required": False,
    "description": "seconds this request may take from its arrival, when less than the server's "
    "`IBEDL_REQUEST_TIMEOUT_S` (which caps it): 503 `overloaded` at once when the queue cannot answer in "
    "time, 504 at once when the request's own model time exceeds it",
    "schema": {"type": "number", "exclusiveMinimum": 0},
}
PREDICT_EXTRA = {"parameters": [TIMEOUT_HEADER]}


def install(app: FastAPI, state: ServiceState) -> None:
    """Serve ``app``'s OpenAPI schema with the limits it enforces: FastAPI's schema of the routes and models
    (built once), with the limits of ``state`` written in on every request for it. Until the adapter has loaded
    its limits are not known and the schema states the settings' (the model routes answer 503 meanwhile)."""
    shapes = app.openapi

    def openapi() -> dict:
        schema = copy.deepcopy(shapes())
        write_limits(schema["components"]["schemas"], state)
        if state.engine.runtimes:  # GET /v1/drift?adapter= and /v1/guarantees?adapter= take the served adapters' names
            for path in ("/v1/drift", "/v1/guarantees"):
                (param,) = [p for p in schema["paths"][path]["get"]["parameters"] if p["name"] == "adapter"]
                _not_null(param["schema"])["enum"] = list(state.engine.runtimes)
        return schema

    app.openapi = openapi


def write_limits(schemas: dict, state: ServiceState) -> None:
    """Write into the request models' JSON schemas (``components.schemas``) what ``requests.to_question``,
    pydantic and the routes enforce beyond the models' shapes."""
    s = state.settings
    runtimes = list(state.engine.runtimes.values())
    # several adapters: a limit that differs between them is written as the loosest (the app checks each)
    n = max(max_options(s, rt) for rt in runtimes) if runtimes else max_options(s, None)

    def text(limit: int) -> dict:
        return {"type": "string", "maxLength": limit, "pattern": NOT_BLANK}

    request = schemas["PredictRequest"]["properties"]
    request["question"].update(text(s.max_question_chars))
    # A map's keys are consecutive letters from A: A and B are required and each later letter needs the one
    # before it (dependentRequired), which is exactly "the first k letters" for 2 <= k <= n.
    request["options"]["anyOf"] = [
        {"type": "array", "items": text(s.max_option_chars), "minItems": 2, "maxItems": n},
        {"type": "object", "properties": {letter: text(s.max_option_chars) for letter in LETTERS[:n]},
         "additionalProperties": False, "required": ["A", "B"], "minProperties": 2, "maxProperties": n,
         "dependentRequired": {LETTERS[i]: [LETTERS[i - 1]] for i in range(2, n)}},
    ]
    context = request["context"]["anyOf"]
    next(branch for branch in context if branch.get("type") == "string")["maxLength"] = s.max_context_chars
    schemas["BatchRequest"]["properties"]["items"]["maxItems"] = s.max_batch_items
    schemas["FeedbackBatchRequest"]["properties"]["items"]["maxItems"] = s.max_batch_items

    if not runtimes:
        return  # the adapters are not loaded: their names and stored prediction sets are not known yet
    _not_null(request["adapter"])["enum"] = list(state.engine.runtimes)
    conformal = schemas["ConformalOptions"]["properties"]
    calibrated = [rt.conformal for rt in runtimes if rt.conformal is not None]
    if not calibrated:  # never calibrated: a request may not ask for a set
        for name in ("alpha", "score"):
            conformal[name] = {"type": "null", "description": "this adapter has no prediction sets (never calibrated)"}
        return
    # A score may be asked alone (with the default alpha), an alpha alone (with the default score), or both:
    # the scores offered hold the default alpha, the alphas offered are stored for every one of those scores.
    alphas, scores = set(), set()
    for c in calibrated:
        offered = sorted(name for name, stored in c.quantiles.items() if alpha_key(c.alpha) in stored)
        scores.update(offered)
        alphas.update(set.intersection(*({float(a) for a in c.quantiles[name]} for name in offered)))
    _not_null(conformal["alpha"])["enum"] = sorted(alphas)
    _not_null(conformal["score"])["enum"] = sorted(scores)


def _not_null(field: dict) -> dict:
    """The non-null branch of an ``X | None`` field's schema."""
    return next(branch for branch in field["anyOf"] if branch.get("type") != "null")
