"""The OpenAPI schema states what the app enforces (its settings, the loaded adapter), documents every status
of a route, and the docs pages load nothing from outside the app."""

import re
import threading

import jsonschema_rs
import pytest

from ibedl.engine.requests import NOT_BLANK
from tests.http_json import ok_json
from tests.serve.test_app import Q

STORED_ALPHAS = [0.01, 0.02, 0.05, 0.1, 0.2]  # what ibedl.training.calibrate stores on the tiny artifact


def request_validator(openapi: dict, name: str = "PredictRequest"):
    root = {"$ref": f"#/components/schemas/{name}", "components": openapi["components"]}
    return jsonschema_rs.Draft202012Validator(root)


class TestLimits:
    def test_schema_states_this_apps_settings(self, make_client):
        with make_client(max_options=5, max_question_chars=100, max_option_chars=50, max_context_chars=300,
                         max_batch_items=3) as c:
            schemas = ok_json(c.get("/openapi.json"))["components"]["schemas"]
        request = schemas["PredictRequest"]["properties"]
        assert (request["question"]["maxLength"], request["question"]["pattern"]) == (100, NOT_BLANK)
        as_list, as_map = request["options"]["anyOf"]
        assert (as_list["minItems"], as_list["maxItems"], as_list["items"]["maxLength"]) == (2, 5, 50)
        assert list(as_map["properties"]) == list("ABCDE") and as_map["additionalProperties"] is False
        assert as_map["required"] == ["A", "B"] and as_map["dependentRequired"] == {"C": ["B"], "D": ["C"], "E": ["D"]}
        assert request["context"]["anyOf"][0]["maxLength"] == 300
        assert schemas["BatchRequest"]["properties"]["items"]["maxItems"] == 3
        conformal = schemas["ConformalOptions"]["properties"]
        assert conformal["alpha"]["anyOf"][0]["enum"] == STORED_ALPHAS
        assert conformal["score"]["anyOf"][0]["enum"] == ["aps", "lac"]

    @pytest.mark.parametrize("body", [
        Q,
        {"question": "q", "options": {"A": "a", "B": "b", "C": "c"}},
        {"question": "q", "options": {"A": "a", "C": "c"}},  # letters not consecutive
        {"question": "q", "options": {"B": "b", "C": "c"}},
        {"question": "q", "options": {"A": "a", "B": "b", "F": "f"}},  # past max_options
        {"question": "q", "options": list("abcde")},
        {"question": "q", "options": list("abcdef")},
        {"question": "q", "options": ["a"]},
        {"question": " \u3000\x1c", "options": ["a", "b"]},
        {"question": "\ufeff", "options": ["a", "b"]},  # not whitespace to str.isspace()
        {"question": "q", "options": ["a", "\t"]},
        {"question": "q", "options": ["a", "b"], "abstain": {"min_confidence": False}},
        {"question": "q", "options": ["a", "b"], "abstain": {"min_confidence": 1}},
        {"question": "q", "options": ["a", "b"], "conformal": {"alpha": 0.1, "score": "aps"}},
        {"question": "q", "options": ["a", "b"], "conformal": {"alpha": 0.1000001}},  # rounds to a stored alpha
        {"question": "q", "options": ["a", "b"], "conformal": {"alpha": 0.15}},
    ])
    def test_schema_admits_what_the_app_accepts(self, make_client, body):
        with make_client(max_options=5) as c:
            admitted = request_validator(ok_json(c.get("/openapi.json"))).is_valid(body)
            r = c.post("/predict", json=body)
        assert admitted == (r.status_code == 200), (admitted, r.status_code, r.text)
        assert r.status_code in (200, 422), r.text

    def test_uncalibrated_adapter_offers_no_prediction_set(self, uncalibrated_artifact, make_client):
        with make_client(artifact=uncalibrated_artifact) as c:
            openapi = ok_json(c.get("/openapi.json"))
            body = {**Q, "conformal": {"alpha": 0.1}}
            assert not request_validator(openapi).is_valid(body)
            assert c.post("/predict", json=body).status_code == 422
            assert c.post("/predict", json={**Q, "conformal": {"alpha": None}}).status_code == 200

    def test_schema_while_loading_states_the_settings(self, make_client):
        gate = threading.Event()

        def loader(settings):
            gate.wait(10)
            from tests.serve.conftest import load_predictor
            return load_predictor(settings)

        with make_client(loader=loader, ready=False, max_options=4) as c:
            schemas = ok_json(c.get("/openapi.json"))["components"]["schemas"]
            gate.set()
        assert schemas["PredictRequest"]["properties"]["options"]["anyOf"][0]["maxItems"] == 4
        assert "enum" not in schemas["ConformalOptions"]["properties"]["alpha"]["anyOf"][0]  # not known yet


class TestStatuses:
    def test_every_status_of_a_route_is_documented(self, client):
        paths = ok_json(client.get("/openapi.json"))["paths"]
        predict = {"200", "400", "401", "408", "413", "415", "422", "500", "503", "504"}
        for path in ("/predict", "/predict/batch"):
            operation = paths[path]["post"]
            assert set(operation["responses"]) == predict
            assert "Retry-After" in operation["responses"]["503"]["headers"]
            (header,) = operation["parameters"]
            assert (header["name"], header["in"], header["required"]) == ("X-Request-Timeout", "header", False)
        assert set(paths["/v1/models"]["get"]["responses"]) == {"200", "401", "500", "503"}
        assert set(paths["/v1/drift"]["get"]["responses"]) == {"200", "401", "422", "500", "503"}  # ?adapter=
        assert set(paths["/health/ready"]["get"]["responses"]) == {"200", "503"}
        assert set(paths["/health/live"]["get"]["responses"]) == {"200"}


class TestDocsPages:
    @pytest.mark.parametrize("page", ["/docs", "/redoc"])
    def test_page_loads_nothing_from_outside(self, client, page):
        r = client.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        urls = re.findall(r"""(?:src|href|spec-url)=["']([^"']+)""", r.text)
        urls += re.findall(r"""url: ?["']([^"']+)""", r.text)  # Swagger UI's schema URL
        assert not re.search(r"https?://|//[a-z]", r.text), r.text
        assert len(urls) >= 2, r.text  # the script (and style) and the favicon, or the schema
        for url in urls:
            asset = client.get(url)
            assert asset.status_code == 200 and len(asset.content) > 0, url
        scripts = re.findall(r"""src=["']([^"']+\.js)""", r.text)
        javascript = ("text/javascript", "application/javascript")
        assert scripts and all(client.get(s).headers["content-type"].startswith(javascript) for s in scripts)
