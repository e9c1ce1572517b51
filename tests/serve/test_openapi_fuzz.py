"""The OpenAPI schema and the app agree: schemathesis runs in-process against the app (ASGI, tiny artifact) with
every check, positive and negative data, through its examples, coverage and fuzzing phases (what
`schemathesis run --checks all --mode all` does against a URL; there are no links, so no stateful phase)."""

import time
from collections import Counter

import pytest
import schemathesis
from schemathesis import engine
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi

from ibedl.serve.app import create_app
from ibedl.serve.contract import TIMEOUT_HEADER
from ibedl.serve.settings import Settings

# 413 is this API's rejection of a value over a length limit the schema states (maxLength, maxItems): the
# negative check counts it as a rejection. A schema-valid request can still get 413 for what no JSON Schema can
# state, the prompt's tokens after formatting and the body's bytes: the positive check allows 413, and the test
# below asserts that every 413 of a positive case names one of those two limits.
POSITIVE_STATUSES = ["2xx", "3xx", "401", "403", "404", "409", "413", "429", "5xx"]  # schemathesis' default + 413
NEGATIVE_STATUSES = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]

CONFIG = {
    "seed": 20240601,
    "generation": {"mode": "all", "max-examples": 60, "deterministic": True, "database": "none"},
    "checks": {
        "enabled": True,
        "max_response_time": 10,  # seconds, as `--checks all` sets it; the tiny model answers in milliseconds
        "positive_data_acceptance": {"expected-statuses": POSITIVE_STATUSES},
        "negative_data_rejection": {"expected-statuses": NEGATIVE_STATUSES},
    },
    "phases": {
        "coverage": {"unexpected-methods": ["get", "put", "post", "patch", "delete", "options", "trace", "query"]},
        "stateful": {"enabled": False},
    },
}


@pytest.fixture(scope="module")
def fuzzed_app(tiny_artifact):
    app = create_app(Settings(artifact=tiny_artifact, drift_bootstrap=100, max_tokens=96))
    try:
        with asgi.get_client(app) as client:  # schemathesis' own client runs the lifespan for its requests
            deadline = time.monotonic() + 60
            while client.get("/health/ready").status_code != 200:  # no 503 not_ready in the run
                assert time.monotonic() < deadline, "the app did not get ready"
                time.sleep(0.05)
        yield app
    finally:
        asgi.shutdown_lifespans()


def without_client_deadlines(raw: dict) -> dict:
    """The app's schema without the optional X-Request-Timeout header. Any positive number is valid there, and one
    shorter than the model time is answered at once by design: 503 when not even an empty question fits it, 504
    otherwise, both 5xx to schemathesis' not_a_server_error. No schema can tell the generator "valid, but long":
    a floor (minimum 60) makes 0 < x < 60 negative data the app rightly accepts. So the header is left out here;
    tests/serve/test_app.py and test_admission.py check what it does, and 422 for a value that is not positive."""
    for path in ("/predict", "/predict/batch"):
        operation = raw["paths"][path]["post"]
        operation["parameters"] = [p for p in operation["parameters"] if p["name"] != TIMEOUT_HEADER["name"]]
    return raw


def test_schema_and_app_agree(fuzzed_app):
    schema = schemathesis.openapi.from_dict(without_client_deadlines(fuzzed_app.openapi()),
                                            config=SchemathesisConfig.from_dict(CONFIG))
    schema.app = fuzzed_app  # what openapi.from_asgi does: requests go to the app in-process
    failures, statuses, checks, positive_413 = [], Counter(), Counter(), []
    for event in engine.from_schema(schema).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            failures.append(f"{type(event).__name__}: {event}")
        if not isinstance(event, events.ScenarioFinished):
            continue
        rec = event.recorder
        for case_id, interaction in rec.interactions.items():
            case, response = rec.cases[case_id].value, interaction.response
            if response is None or case.meta is None:
                continue
            mode = case.meta.generation.mode
            statuses[(rec.label, mode, response.status_code)] += 1
            if mode == GenerationMode.POSITIVE and response.status_code == 413:
                positive_413.append(response.json()["error"]["message"])
        for case_id, nodes in rec.checks.items():
            for node in nodes:
                checks[node.name] += 1
                if node.status == Status.FAILURE:
                    failure = node.failure_info.failure
                    failures.append(f"{node.name} on {rec.label}: {failure.title}: {failure.message}\n"
                                    f"body: {rec.cases[case_id].value.body!r}"[:1500])
    print(f"{sum(statuses.values())} cases, checks run: {dict(checks)}")
    print("statuses:", sorted((label, mode.value, code, n) for (label, mode, code), n in statuses.items()))
    assert not failures, "\n\n".join(dict.fromkeys(failures))  # each distinct failure once
    assert len(checks) == 15, sorted(checks)  # every built-in check ran
    assert all(" tokens after formatting" in m or " bytes" in m for m in positive_413), positive_413
    for label in ("POST /predict", "POST /predict/batch"):  # both kinds of data reached the model and the checks
        assert statuses[(label, GenerationMode.POSITIVE, 200)] >= 10, statuses
        assert statuses[(label, GenerationMode.NEGATIVE, 422)] >= 10, statuses
