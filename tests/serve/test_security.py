"""Who may call what: the bearer tokens on every route but the health probes (found from the app's own routes, so a
new route is checked without being listed here), the metrics token, the labelling credential (the feedback routes'
alone), token hygiene, request ids, bounded names, and the request checks running off the event loop."""

import threading

import pytest
from pydantic import ValidationError
from starlette.routing import Mount

from ibedl.serve.__main__ import main
from ibedl.serve.middleware import REQUEST_ID
from ibedl.serve.settings import Settings

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree", "fish"]}
API, METRICS, LABEL = "s3cret-api", "s3cret-metrics", "s3cret-label"
PROBES = {"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"}  # the last two: the OIP's
# an Open Inference Protocol request (ibedl/serve/oip.py), for its infer route
INFER = {"inputs": [{"name": "question", "shape": [1], "datatype": "BYTES", "data": [Q["question"]]},
                    {"name": "options", "shape": [1, 4], "datatype": "BYTES", "data": Q["options"]}]}
LABELLING = ("/v1/feedback", "/v1/feedback/batch")
# the feedback routes answer 404 feedback_disabled without a receipt key, and 422 to a question's body: their own
# answer (not 401) is what shows the token let the request through
NEEDS_A_RECEIPT = ("/v1/feedback", "/v1/guarantees")


def passed_auth(r, path: str) -> bool:
    if path.startswith(NEEDS_A_RECEIPT):
        return r.status_code in (404, 422) and r.json()["error"]["type"] != "unauthorized"
    return r.status_code == 200


def routes(app, prefix: str = "") -> list[tuple[str, str]]:
    """(method, path) of every route of ``app`` (an app or a router) besides HEAD, included routers' routes too (a
    mount: a file under it)."""
    found = []
    for route in app.routes:
        if isinstance(route, Mount):
            found.append(("GET", prefix + route.path + "/swagger-ui.css"))
        elif hasattr(route, "original_router"):  # FastAPI's include_router
            found += routes(route.original_router, prefix + route.include_context.prefix)
        else:
            found += [(m, prefix + route.path) for m in sorted(route.methods - {"HEAD"})]
    return found


def call(client, method: str, path: str, token: str | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    body = ({"items": [Q]} if path.endswith("/batch") else INFER if path.endswith("/infer") else Q) \
        if method == "POST" else None
    path = path.replace("{model}", "tiny").replace("{version}", "1")  # the tiny artifact's version: its first
    return client.request(method, path, json=body, headers=headers)


def error_type(r, path: str) -> str:
    """The refusal's type: ``{"error": {"type": ...}}``, or the Open Inference Protocol's ``{"error": "type: ..."}``."""
    error = r.json()["error"]
    return error.split(":")[0] if path.startswith("/v2/") else error["type"]


class TestTokens:
    def test_every_route_but_the_probes_and_static_assets_requires_the_token(self, make_client):
        """Each route takes its own token alone: the API token, the metrics token on /metrics, the labelling
        credential on the feedback routes (where the API token, known but not allowed, gets 403)."""
        with make_client(api_token=API, metrics_token=METRICS, label_token=LABEL) as c:
            checked = set()
            for method, path in routes(c.app):
                open_ = path in PROBES or path.startswith("/docs/assets/")
                token = METRICS if path == "/metrics" else LABEL if path in LABELLING else API
                for given in (None, "wrong", *(t for t in (API, METRICS, LABEL) if t != token)):
                    r = call(c, method, path, given)
                    if open_:
                        assert r.status_code == 200, (method, path, r.status_code)
                        continue
                    if path in LABELLING and given == API:
                        assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden", (path, r.text)
                        continue
                    assert r.status_code == 401, (method, path, given, r.status_code, r.text)
                    assert r.headers["www-authenticate"] == "Bearer"
                    assert error_type(r, path) == "unauthorized"
                r = call(c, method, path, token)
                assert passed_auth(r, path), (method, path, r.status_code, r.text)
                checked.add(path)
            # the test saw the routes it is about (the schema, the docs, predict, batch, drift, models, metrics)
            assert {"/predict", "/predict/batch", "/v1/models", "/v1/drift", "/openapi.json", "/docs", "/redoc",
                    "/metrics", "/v2/models/{model}/infer", "/v2", *PROBES} <= checked, checked

    def test_a_path_no_route_takes_needs_the_token_too(self, make_client):
        with make_client(api_token=API) as c:
            assert c.get("/v1/no-such-route").status_code == 401  # an anonymous client learns nothing of the routes
            for path in ("/health/other", "/v2/health/x", "/health/live/"):  # the probes are open by exact path
                assert c.get(path).status_code == 401, path
            assert c.get("/v1/no-such-route", headers={"Authorization": f"Bearer {API}"}).status_code == 404

    def test_metrics_take_the_api_token_when_no_metrics_token_is_set(self, make_client):
        with make_client(api_token=API) as c:
            assert c.get("/metrics").status_code == 401
            r = c.get("/metrics", headers={"Authorization": f"Bearer {API}"})
            assert r.status_code == 200 and "ibedl_ready 1.0" in r.text

    @pytest.mark.parametrize("settings, given, status", [
        ({"api_token": API}, API, 403),  # no labelling credential configured: nobody may label
        ({"api_token": API}, None, 401),
        ({"host": "0.0.0.0", "allow_anonymous": True}, None, 403),  # open on purpose, but not to labels
        ({"label_token": LABEL}, None, 401),  # a loopback service without an API token: labels still need theirs
        ({"label_token": LABEL}, LABEL, 404),  # through (no receipt key here: feedback_disabled)
        ({}, None, 404),  # loopback, no token at all: local use, labels open too
    ])
    def test_who_may_send_labels(self, make_client, settings, given, status):
        with make_client(**settings) as c:
            r = c.post("/v1/feedback", json={"receipt": "v1.x.y", "label": "A"},
                       headers={"Authorization": f"Bearer {given}"} if given else {})
            assert r.status_code == status, r.text
            if status == 403:
                assert r.json()["error"]["type"] == "forbidden" and "IBEDL_LABEL_TOKEN" in r.json()["error"]["message"]
            if status != 401:  # the API routes are as open as before
                assert call(c, "GET", "/v1/models", given if given != LABEL else None).status_code == 200

    def test_without_tokens_everything_is_open(self, client):
        for method, path in routes(client.app):
            assert passed_auth(call(client, method, path), path), (method, path)

    def test_token_is_checked_before_the_body_is_read(self, make_client):
        with make_client(api_token=API) as c:
            r = c.post("/predict", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 401
            r = c.post("/predict", content=b"x" * 2_000_000, headers={"content-type": "application/json"})
            assert r.status_code == 401  # not 413: an unauthenticated client learns nothing of the limits

    def test_surrounding_whitespace_of_a_configured_token_is_dropped(self, make_client):
        with make_client(api_token=f"  {API}\n") as c:  # as a Secret file with a trailing newline gives it
            assert c.post("/predict", json=Q, headers={"Authorization": f"Bearer {API}"}).status_code == 200
            assert c.post("/predict", json=Q, headers={"Authorization": f"Bearer {API}\n"[:-1] + "x"}).status_code \
                == 401

    @pytest.mark.parametrize("blank", ["", "   ", "\n"])
    def test_an_empty_token_is_no_token(self, blank, monkeypatch):
        monkeypatch.setenv("IBEDL_API_TOKEN", blank)
        monkeypatch.setenv("IBEDL_METRICS_TOKEN", blank)
        s = Settings()
        assert s.api_token is None and s.metrics_token is None and s.metrics_secret() is None

    @pytest.mark.parametrize("bad", ["two words", "caf\u00e9-token", "tab\there"])
    def test_a_token_no_client_could_send_is_refused_without_echoing_it(self, bad, monkeypatch, capsys):
        with pytest.raises(ValidationError):
            Settings(api_token=bad)
        monkeypatch.setenv("IBEDL_API_TOKEN", bad)
        assert main(["--port", "0"]) == 2  # what the operator sees: the rule, never the token
        err = capsys.readouterr().err
        assert "IBEDL_API_TOKEN: Value error, a token holds only visible ASCII" in err and bad not in err

    def test_the_labelling_credential_is_a_secret_of_its_own(self, monkeypatch, capsys):
        settings = Settings(label_token=f" {LABEL}\n")  # a Secret file's newline dropped
        assert settings.label_token.get_secret_value() == LABEL and LABEL not in repr(settings)
        for other in ("api_token", "metrics_token"):
            with pytest.raises(ValidationError, match=f"must differ from IBEDL_{other.upper()}"):
                Settings(label_token=LABEL, **{other: LABEL})
        monkeypatch.setenv("IBEDL_API_TOKEN", LABEL)
        monkeypatch.setenv("IBEDL_LABEL_TOKEN", LABEL)
        assert main(["--port", "0"]) == 2
        err = capsys.readouterr().err
        assert "IBEDL_LABEL_TOKEN: Value error, the labelling credential must differ from IBEDL_API_TOKEN" in err
        assert LABEL not in err

    def test_other_bad_settings_show_the_value_given(self, monkeypatch, capsys):
        monkeypatch.setenv("IBEDL_PORT", "70000")
        assert main([]) == 2
        assert "IBEDL_PORT: Input should be less than or equal to 65535 (got '70000')" in capsys.readouterr().err


class TestRequestIds:
    @pytest.mark.parametrize("given", ["abc-123", "a" * 128, "trace:1/span=2+x@y.z_w"])
    def test_a_sane_id_is_kept(self, client, given):
        r = client.get("/health/live", headers={"X-Request-ID": given})
        assert r.status_code == 200 and r.headers["x-request-id"] == given

    @pytest.mark.parametrize("given", ["a" * 129, "has space", "semi;colon", "quote\"d", "new\\line", "\u00e9t\u00e9"])
    def test_any_other_is_replaced_by_a_new_one(self, client, given):
        r = client.post("/predict", json=Q, headers={"X-Request-ID": given.encode("utf-8")})
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert rid != given and len(rid) == 32 and int(rid, 16) >= 0
        assert r.json()["id"] == rid  # the answer is named after the id the service chose

    def test_the_pattern_matches_the_documented_rule(self):
        assert REQUEST_ID.fullmatch("A-z_0.9:@/+=")
        assert not REQUEST_ID.fullmatch("") and not REQUEST_ID.fullmatch("x" * 129)


class TestBoundedNames:
    def test_an_adapter_name_over_the_limit_is_refused(self, client):
        r = client.post("/predict", json={**Q, "adapter": "x" * 129})
        assert r.status_code == 422 and r.json()["error"]["field"] == "adapter"
        assert "x" * 129 not in r.text
        r = client.get("/v1/drift", params={"adapter": "x" * 129})
        assert r.status_code == 422
        r = client.post("/predict", json={**Q, "adapter": "x" * 128})
        assert r.status_code == 422 and r.json()["error"]["field"] == "adapter"  # in bounds, but not served


def test_requests_are_checked_off_the_event_loop(make_client, monkeypatch):
    import ibedl.engine.engine as engine_module

    threads = []
    original = engine_module.to_question

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_module, "to_question", recording)
    with make_client() as c:
        assert c.post("/predict", json=Q).status_code == 200
        assert c.post("/predict/batch", json={"items": [Q, Q]}).status_code == 200
    assert len(threads) == 3 and all(name.startswith("ibedl-check") for name in threads), threads
