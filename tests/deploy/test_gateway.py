"""The gateway (deploy/nginx/nginx.conf, rendered for loopback) in front of two stub replicas whose behaviour each
test sets: a request is tried on another replica only when the first surely did not process it (connection
refused, or a 503 refusal: once), never after a timeout or a failure once it was sent; the service's own answers
pass through; the per-client request and connection limits answer 429; no response names a replica; request ids
are kept when sane and replaced otherwise; labels sent through it take the labelling credential, keep their
receipt's first label and stay within the credential's quota, with the service's own 403, 409 and 429 passed on.

Stub replicas (not the real service) make each failure exact and cheap; the labelling test runs two real replicas
of the tiny artifact on one feedback store, and tests/deploy/test_topology.py runs the same gateway in front of
replicas of the real model. nginx is required (make test installs it): no skip."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from benchmarks.service_process import free_port
from tests.deploy.render import nginx_command, render_nginx, require_binary
from tests.serve.conftest import uvicorn_server

pytestmark = pytest.mark.servers

READ_TIMEOUT_S = 2  # the rendered gateway's proxy_read_timeout (35 s as shipped)
Q = {"question": "Which is sun?", "options": ["sun", "moon"]}


class Replica:
    """A stub replica on 127.0.0.1: records every request it reads, answers as ``mode`` says."""

    def __init__(self):
        self.mode = "ok"
        self.received: list[dict] = []
        self.release = threading.Event()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                replica.received.append({"method": self.command, "path": self.path, "body": body,
                                         "request_id": self.headers.get("x-request-id")})
                mode = replica.mode
                if mode == "close":  # read the request, then die without an answer (a crash mid-request)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if mode == "hang":  # answer long after the gateway's read timeout
                    time.sleep(READ_TIMEOUT_S + 2)
                if mode == "block" and self.command == "POST":
                    replica.release.wait(30)
                status, headers, payload = {
                    "503": (503, {"Retry-After": "7"}, {"error": {"type": "overloaded", "message": "busy"}}),
                    "413": (413, {}, {"error": {"type": "too_large", "message": "the prompt is 2000 tokens",
                                                "field": "context"}}),
                    "500": (500, {}, {"error": {"type": "model_error", "message": "nan"}}),
                    "504": (504, {}, {"error": {"type": "timeout", "message": "service deadline"}}),
                }.get(mode, (200, {}, {"port": replica.port, "body": body.decode()}))
                out = json.dumps(payload).encode()
                self.send_response(status)
                for k, v in {"content-type": "application/json", "content-length": str(len(out)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = handle_one

            def log_message(self, *args):
                pass

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a gateway that gave up on a hanging or blocked stub: its broken pipe is expected

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def start_gateway(workdir, replica_ports: list[int], read_timeout_s: int | None = READ_TIMEOUT_S):
    """nginx with the rendered gateway config in front of ``replica_ports``; returns (url, process)."""
    port = free_port()
    conf = render_nginx(workdir, port, [f"127.0.0.1:{p}" for p in replica_ports], read_timeout_s=read_timeout_s)
    proc = subprocess.Popen(nginx_command(conf, "-g", "daemon off;"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, (workdir / "error.log").read_text()
        try:
            if httpx.get(url + "/gateway/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.TransportError:
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.1)


@contextlib.contextmanager
def running(workdir, read_timeout_s: int | None = READ_TIMEOUT_S):
    """A fresh gateway (no replica marked failed by an earlier test) in front of two stub replicas."""
    require_binary("nginx")
    replicas = [Replica(), Replica()]
    proc = None
    try:
        url, proc = start_gateway(workdir, [r.port for r in replicas], read_timeout_s)
        yield url, replicas
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        for r in replicas:
            r.close()


@pytest.fixture
def stubs(tmp_path):
    with running(tmp_path / "nginx") as started:
        yield started


def post(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + "/predict", json=body, timeout=30, **kwargs)


def by_body(replicas) -> dict[str, list[int]]:
    """Which replicas (by index) received each request body."""
    seen = defaultdict(list)
    for i, r in enumerate(replicas):
        for req in r.received:
            seen[req["body"].decode()].append(i)
    return seen


def test_a_503_refusal_is_tried_once_more_on_the_other_replica(stubs):
    url, (refusing, ok) = stubs
    refusing.mode = "503"
    bodies = [json.dumps({**Q, "id": f"q{k}"}) for k in range(6)]
    for body in bodies:
        r = httpx.post(url + "/predict", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["port"] == ok.port and r.json()["body"] == body  # the whole body, sent again
    seen = by_body([refusing, ok])
    assert sorted(seen) == sorted(bodies)
    assert all(where in ([1], [0, 1]) for where in seen.values()), seen  # refused at most once, answered once
    assert any(where == [0, 1] for where in seen.values()), "the refusing replica was never tried first"


def test_when_every_replica_refuses_the_client_gets_the_second_refusal(stubs):
    url, replicas = stubs
    for r in replicas:
        r.mode = "503"
    r = post(url, Q)
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["type"] == "overloaded"  # the replica's answer, passed through
    assert sum(len(x.received) for x in replicas) == 2  # one try and one retry, no more


def test_a_replica_that_fails_after_receiving_the_request_is_not_replayed(stubs):
    url, (crashing, ok) = stubs
    crashing.mode = "close"
    codes = [post(url, {**Q, "id": f"c{k}"}).status_code for k in range(6)]
    seen = by_body([crashing, ok])
    assert all(len(where) == 1 for where in seen.values()), seen  # no request reached both replicas
    assert codes.count(502) == len(crashing.received) >= 1 and codes.count(200) == len(ok.received), (codes, seen)


def test_a_request_that_times_out_at_one_replica_is_not_sent_to_another(stubs):
    url, (hanging, ok) = stubs
    hanging.mode = "hang"
    answers = [post(url, {**Q, "id": f"t{k}"}) for k in range(4)]
    seen = by_body([hanging, ok])
    assert all(len(where) == 1 for where in seen.values()), seen  # the timed-out ones never reached `ok`
    timed_out = [r for r in answers if r.status_code == 504]
    assert len(timed_out) == len(hanging.received) >= 1
    assert all(r.json()["error"]["type"] == "timeout" for r in timed_out)
    assert [r.status_code for r in answers].count(200) == len(ok.received)


def test_a_refused_connection_is_retried_on_the_next_replica(tmp_path):
    live = Replica()
    proc = None
    try:
        url, proc = start_gateway(tmp_path / "nginx", [free_port(), live.port])  # nothing listens on the first
        for k in range(4):
            r = post(url, {**Q, "id": f"r{k}"})
            assert r.status_code == 200 and r.json()["port"] == live.port, r.text
        assert len(live.received) == 4
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        live.close()


@pytest.mark.parametrize("mode", ["413", "500"])
def test_the_services_own_answers_pass_unchanged(stubs, mode):
    url, replicas = stubs
    for r in replicas:
        r.mode = mode
    r = post(url, Q)
    assert r.status_code == int(mode)
    assert r.json()["error"]["message"] in ("the prompt is 2000 tokens", "nan")
    assert sum(len(x.received) for x in replicas) == 1  # not retried


def test_a_service_504_comes_back_as_a_timeout_without_a_retry(stubs):
    url, replicas = stubs
    for r in replicas:
        r.mode = "504"
    r = post(url, Q)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert sum(len(x.received) for x in replicas) == 1


def test_no_response_names_a_replica_and_request_ids_are_kept_or_replaced(stubs):
    url, replicas = stubs
    addresses = [f"127.0.0.1:{r.port}" for r in replicas] + [str(r.port) for r in replicas]
    for k, (rid, kept) in enumerate([("client-id-1", True), ("bad id with spaces", False), ("x" * 129, False)]):
        body = {**Q, "id": f"i{k}"}
        r = post(url, body, headers={"X-Request-ID": rid})
        assert r.status_code == 200
        assert "x-upstream" not in r.headers
        assert not any(a in value for a in addresses for name, value in r.headers.items()), dict(r.headers)
        got = r.headers["x-request-id"]
        assert (got == rid) if kept else (len(got) == 32 and int(got, 16) >= 0)
        (forwarded,) = [req["request_id"] for x in replicas for req in x.received if json.loads(req["body"]) == body]
        assert forwarded == got  # the replica saw the id the client got back
    for path in ("/gateway/health", "/metrics", "/no/such/route"):
        r = httpx.get(url + path, timeout=10)
        assert not any(a in value for a in addresses for _, value in r.headers.items())


def test_too_many_connections_from_one_client_get_429(tmp_path):
    with running(tmp_path / "nginx", read_timeout_s=None) as (url, replicas), ThreadPoolExecutor(16) as pool:
        for r in replicas:
            r.mode = "block"
        held = [pool.submit(post, url, {**Q, "id": f"h{k}"}) for k in range(16)]
        deadline = time.monotonic() + 20
        while sum(len(r.received) for r in replicas) < 16:
            assert time.monotonic() < deadline, "the 16 requests did not reach the replicas"
            time.sleep(0.05)
        r = post(url, Q)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "too_many_requests" and len(r.headers["x-request-id"]) == 32
        assert httpx.get(url + "/health/live", timeout=10).status_code == 200  # probes are not limited
        for rep in replicas:
            rep.release.set()
        assert [f.result().status_code for f in held] == [200] * 16


def test_a_burst_over_the_request_rate_gets_429(stubs):
    url, _ = stubs
    codes = []
    with httpx.Client(timeout=10) as client:
        while 429 not in codes and len(codes) < 2000:
            codes.append(client.get(url + "/v1/models").status_code)
    assert 429 in codes, "2000 requests in a row never hit the limit"
    assert codes.index(429) >= 41  # the burst of 40 (and the first) passes


# -- labels through the gateway, to real replicas ------------------------------------------------------------------

API, LABEL = "gateway-api-token", "gateway-label-token"
AS_CLIENT, AS_LABELLER = {"Authorization": f"Bearer {API}"}, {"Authorization": f"Bearer {LABEL}"}


@pytest.fixture
def labelled(tiny_artifact, tmp_path):
    """The gateway in front of two real replicas (the tiny artifact) that share one feedback store, with tokens as
    deployed and a quota of 2 labels per hour for the labelling credential; yields (gateway url, replica urls)."""
    from ibedl.serve.app import create_app
    from ibedl.serve.settings import Settings

    require_binary("nginx")
    settings = Settings(artifact=tiny_artifact, drift_bootstrap=100, max_tokens=96, feedback_key="gateway-feedback-key",
                        feedback_db=tmp_path / "feedback.sqlite", api_token=API, label_token=LABEL, max_labels=2)
    proc = None
    with uvicorn_server(create_app(settings)) as one, uvicorn_server(create_app(settings)) as two:
        try:
            url, proc = start_gateway(tmp_path / "nginx", [int(u.rsplit(":", 1)[1]) for u in (one, two)])
            yield url, (one, two)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)


def replica_metric(urls, sample: str) -> float:
    """``sample`` (name and labels, as exposed) summed over the replicas; 0 where a replica has none."""
    total = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", headers=AS_CLIENT, timeout=10).text.splitlines():
            if line.startswith(sample + " "):
                total += float(line.split()[-1])
    return total


def test_labels_through_the_gateway_take_the_labelling_credential_and_keep_the_first(labelled):
    url, replicas = labelled
    with httpx.Client(base_url=url, timeout=30) as gw:
        answers = [gw.post("/predict", json={**Q, "id": f"l{k}"}, headers=AS_CLIENT).json() for k in range(3)]
        assert all(a["receipt"] for a in answers), answers
        label = {"receipt": answers[0]["receipt"], "label": "A"}

        def guarantees() -> tuple[list[dict], int]:
            """The shared sequences (the same from either replica: one store) and the conflicts both replicas
            refused (each process counts its own, as the metric)."""
            bodies = [httpx.get(u + "/v1/guarantees", headers=AS_CLIENT, timeout=10).json() for u in replicas]
            conflicts = sum(b.pop("conflicts").get("tiny", 0) for b in bodies)
            assert bodies[0] == bodies[1]
            return bodies[0]["guarantees"], conflicts

        # the API token (what every client holds) may not label: the service's 403, nothing stored or counted
        for path, body in (("/v1/feedback", label), ("/v1/feedback/batch", {"items": [label]})):
            r = gw.post(path, json=body, headers=AS_CLIENT)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["type"] == "forbidden" and "IBEDL_LABEL_TOKEN" in r.json()["error"]["message"]
        assert gw.post("/v1/feedback", json=label).status_code == 401
        assert guarantees()[0] == []
        assert replica_metric(replicas, 'ibedl_feedback_labels_total{adapter="tiny",status="recorded"}') == 0

        # the labelling credential records it once; the same label again is a duplicate on either replica
        r = gw.post("/v1/feedback", json=label, headers=AS_LABELLER)
        assert r.status_code == 200 and r.json()["recorded"] == 1, r.text
        for _ in range(2):
            r = gw.post("/v1/feedback", json=label, headers=AS_LABELLER)
            assert r.status_code == 200 and r.json()["duplicates"] == 1, r.text
        recorded = guarantees()[0]

        # another label for it: the service's 409, not retried, counted once, nothing changed
        r = gw.post("/v1/feedback", json={**label, "label": "B"}, headers=AS_LABELLER)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["type"] == "label_conflict" and r.json()["error"]["field"] == "label"
        assert replica_metric(replicas, 'ibedl_feedback_conflicts_total{adapter="tiny"}') == 1
        sequences, conflicts = guarantees()
        assert conflicts == 1  # on whichever replica refused it, as the metric
        assert sequences == recorded

        # the credential's quota (2 per hour here), counted across both replicas: the service's 429 comes through
        r = gw.post("/v1/feedback", json={"receipt": answers[1]["receipt"], "label": "A"}, headers=AS_LABELLER)
        assert r.status_code == 200, r.text
        r = gw.post("/v1/feedback", json={"receipt": answers[2]["receipt"], "label": "A"}, headers=AS_LABELLER)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "too_many_labels"  # not the gateway's too_many_requests
        assert 1 <= int(r.headers["retry-after"]) <= 3600
        assert [g["labels"] for g in guarantees()[0] if g["guarantee"] == "answered_share"] == [2]
