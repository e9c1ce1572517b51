"""Property-based fuzzing of the OpenAPI schema against a live server: no input produces a 5xx."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.conftest import ServiceProcess


@pytest.fixture(scope="module")
def live(tiny_artifact, tmp_path_factory):
    server = ServiceProcess(tiny_artifact, {"IBEDL_DRIFT_BOOTSTRAP": "100"}, tmp_path_factory.mktemp("fuzz") / "service.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_no_server_errors(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    failures, calls = [], []
    for operation in schema.get_all_operations():
        op = operation.ok()

        @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def run(case):
            response = case.call_and_validate(base_url=live.url, timeout=30, checks=[not_a_server_error])
            calls.append((op.label, response.status_code))
            if response.status_code >= 500:
                failures.append((op.label, case.body, response.status_code, response.text[:300]))
            assert response.status_code < 500
            if response.status_code >= 400:
                assert set(response.json()) == {"error"}, response.text  # one error shape everywhere

        run()
    assert not failures, failures[:3]
    predict = [status for label, status in calls if label == "POST /predict"]
    assert len(predict) >= 30 and {200, 422} <= set(predict), sorted(set(predict))  # both valid and invalid inputs reached
