"""The process meeting the network: a non-loopback bind without a token refuses to start (unless
IBEDL_ALLOW_ANONYMOUS=true, which it logs), the start log says who may send labels, and the real uvicorn server
closes connections that never send their headers and answers 503 over IBEDL_MAX_CONNECTIONS."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn

from benchmarks.service_process import bound_socket, free_port
from ibedl.serve.__main__ import main
from ibedl.serve.server import CLOSE, log_exposure, refusal, uvicorn_config
from ibedl.serve.settings import Settings


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_needs_no_token(host):
    assert refusal(Settings(host=host)) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "api.example"])
def test_any_other_address_needs_a_token_or_the_explicit_override(host):
    message = refusal(Settings(host=host))
    assert message and f"refusing to serve {host}:8000 without a token" in message
    assert "IBEDL_API_TOKEN" in message and "IBEDL_ALLOW_ANONYMOUS=true" in message
    assert refusal(Settings(host=host, api_token="t0ken")) is None
    assert refusal(Settings(host=host, allow_anonymous=True)) is None


def test_main_refuses_to_start_on_all_interfaces_without_a_token(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("IBEDL_API_TOKEN", raising=False)
    monkeypatch.delenv("IBEDL_ALLOW_ANONYMOUS", raising=False)
    assert main(["--host", "0.0.0.0", "--port", str(free_port()), "--artifact", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: refusing to serve 0.0.0.0:") and "IBEDL_ALLOW_ANONYMOUS=true" in err


def serve(args: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ibedl.serve", "--grpc-port", "0", *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def test_a_refused_start_exits_2_before_loading_anything(tiny_artifact, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEDL_")} | {
        "IBEDL_CACHE_DIR": os.environ["IBEDL_CACHE_DIR"]}
    r = subprocess.run([sys.executable, "-m", "ibedl.serve", "--host", "0.0.0.0", "--port", str(free_port()),
                        "--artifact", str(tiny_artifact)], env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 2, r.stderr
    assert "refusing to serve 0.0.0.0" in r.stderr and "Loading" not in r.stderr


def test_allow_anonymous_starts_open_and_says_so(tiny_artifact, tmp_path):
    import httpx

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEDL_")} | {
        "IBEDL_CACHE_DIR": os.environ["IBEDL_CACHE_DIR"], "IBEDL_ALLOW_ANONYMOUS": "true", "IBEDL_MAX_TOKENS": "96",
        "IBEDL_DRIFT_BOOTSTRAP": "100", "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = serve(["--host", "0.0.0.0", "--port", str(port), "--artifact", str(tiny_artifact)], env, log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/predict", timeout=30,
                       json={"question": "Which is sun?", "options": ["sun", "moon"]})
        assert r.status_code == 200, r.text  # open: no token asked
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    text = log_path.read_text()
    assert code == 0, text
    assert f"IBEDL_ALLOW_ANONYMOUS=true: serving 0.0.0.0:{port} OPEN, without a token" in text
    # IBEDL_GC_FREEZE's default (no IBEDL_ variable reaches this process but the cache's): the heap frozen once ready
    assert re.search(r"froze the [1-9]\d* objects the garbage collector tracks out of its scans", text), text


@pytest.mark.parametrize("settings, line", [
    ({"label_token": "l" * 16}, "labels (POST /v1/feedback) require the labelling credential (IBEDL_LABEL_TOKEN), "
                                "at most 5000 per 3600 s"),
    ({"api_token": "a" * 16}, "labels (POST /v1/feedback) are refused: set IBEDL_LABEL_TOKEN to accept them"),
    ({}, "labels (POST /v1/feedback) are accepted without a token (loopback, no IBEDL_API_TOKEN)"),
])
def test_the_start_log_says_who_may_send_labels(caplog, settings, line):
    with caplog.at_level("INFO", logger="ibedl.serve"):
        log_exposure(Settings(feedback_key="k" * 16, **settings))
        log_exposure(Settings(**settings))  # feedback off: nothing about labels
    assert [r.getMessage() for r in caplog.records].count(line) == 1
    assert not any("l" * 16 in r.getMessage() or "a" * 16 in r.getMessage() for r in caplog.records)


def test_the_start_log_warns_of_labels_kept_in_one_process(caplog, tmp_path):
    line = ("labelled feedback keeps its labels in this process only (no IBEDL_FEEDBACK_DB or IBEDL_FEEDBACK_DSN): "
            "with several replicas each counts its own, and a restart forgets them")
    exposed = {"host": "0.0.0.0", "api_token": "a" * 16, "feedback_key": "k" * 16}
    with caplog.at_level("INFO", logger="ibedl.serve"):
        log_exposure(Settings(**exposed))
        log_exposure(Settings(**exposed, feedback_db=tmp_path / "f.sqlite"))  # a shared store: no warning
        log_exposure(Settings(feedback_key="k" * 16))  # loopback: one process is all there is
    assert [r.getMessage() for r in caplog.records].count(line) == 1


async def read_body(receive, on_chunk=None) -> bytes:
    """An ASGI app's whole request body; ``on_chunk()`` after each part that carried bytes."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if message.get("body") and on_chunk is not None:
            on_chunk()
        if not message.get("more_body"):
            return body


async def respond(send, body: bytes) -> None:
    """An ASGI app's answer: 200 with ``body``."""
    length = str(len(body)).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", length)]})
    await send({"type": "http.response.body", "body": body})


class Running:
    """A real uvicorn server, configured as the service configures it, in a thread, around a trivial app, on a socket
    bound here (no other process can take its port first)."""

    def __init__(self, app=None, **settings):
        async def ok(scope, receive, send):
            if scope["type"] != "http":
                return
            await respond(send, b"ok")

        app = app or ok
        self.sock = bound_socket()
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, Settings(port=self.port, **settings)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return s


def test_a_connection_that_never_finishes_its_headers_is_closed():
    with Running(header_timeout_s=0.3) as srv:
        slow = srv.connect()
        slow.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        prompt = srv.connect()
        prompt.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert prompt.recv(1024).startswith(b"HTTP/1.1 200")
        assert slow.recv(1024) == b"", "the server kept a connection without complete headers"  # closed, no answer
        idle = srv.connect()  # sends nothing at all
        assert idle.recv(1024) == b""
        for s in (slow, prompt, idle):
            s.close()


def read_response(s: socket.socket, until: bytes | None = None) -> bytes:
    """What the server sends on ``s``: up to and including ``until``, or everything until it closes ``s``."""
    data = b""
    while until is None or not data.endswith(until):
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:  # closed with bytes of ours unread: what came before the reset is the answer
            break
        if not chunk:
            break
        data += chunk
    return data


def test_a_request_sent_on_an_idle_connection_as_shutdown_begins_is_answered_not_reset():
    """uvicorn closed idle kept-alive connections at shutdown, resetting a request the peer had just sent on one (the
    gateway answered that POST with 502: it cannot retry a request it already sent). The request is answered, with
    Connection: close, and the connection then closed."""
    srv = Running(header_timeout_s=30, shutdown_grace_s=120)
    with srv:
        kept, idle = srv.connect(), srv.connect()
        for s in (kept, idle):
            s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            first = read_response(s, until=b"\r\n\r\nok")  # head and body come in separate writes
            assert first.startswith(b"HTTP/1.1 200") and b"connection: close" not in first.lower()  # kept alive
        srv.server.should_exit = True
        deadline = time.monotonic() + 10
        while True:  # the listener closes first; the connections' shutdown follows in the same step
            try:
                socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "the server did not begin its shutdown"
            time.sleep(0.02)
        kept.sendall(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        answer = read_response(kept)  # to the end: the server closes the connection after it
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nok"), answer
        assert b"connection: close" in answer.lower()
        assert CLOSE not in srv.server.server_state.default_headers  # that response's own, not every one's
        # the idle one is closed by its keep-alive timer (5 s), not at the end of the 120 s grace
        assert read_response(idle) == b""
        srv.thread.join(60)
        assert not srv.thread.is_alive(), "the server did not exit once its connections closed"
        kept.close()
        idle.close()


def test_a_connection_idle_after_a_body_that_ended_past_its_early_response_is_closed():
    """The service may answer before reading the body (a refusal); when the body's end arrives later the connection
    is idle with neither timer armed (the keep-alive one is cancelled by that data): the header timer covers it."""
    with Running(header_timeout_s=0.3) as srv:
        s = srv.connect()
        s.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n{}")
        assert read_response(s, until=b"\r\n\r\nok").startswith(b"HTTP/1.1 200")  # answered before the body ended
        s.sendall(b"{}")
        assert s.recv(1024) == b"", "an idle connection was kept with no timer to close it"
        s.close()


def test_a_request_slower_than_the_header_timeout_is_answered():
    """The header timer is for a request's headers: once they are in, the request is answered however long the app
    takes (a pass on a busy model), and the connection's timer starts again after the response."""
    import asyncio

    reached, release = threading.Event(), threading.Event()

    async def slow(scope, receive, send):
        if scope["type"] != "http":
            return
        reached.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait)
        await respond(send, b"slow")

    with Running(app=slow, header_timeout_s=0.3) as srv:
        s = srv.connect()
        s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert reached.wait(10)
            witness = srv.connect()  # opened after the request's headers, it sends nothing: its header timer
            assert witness.recv(1024) == b""  # closing it shows the request's own (armed earlier) would have fired
        finally:
            release.set()  # else the app's thread waits for ever and the server never stops
        assert read_response(s, until=b"\r\n\r\nslow").startswith(b"HTTP/1.1 200")
        s.settimeout(3)  # the header timer (0.3 s), not the keep-alive one (5 s)
        assert s.recv(1024) == b"", "the idle connection after the response was not closed by its header timer"
        for c in (s, witness):
            c.close()


# A request's head (target, header lines) and a trailer at most: h11's max_incomplete_event_size, which uvicorn keeps.
# (uvicorn's httptools protocol bounds none: docs/results.md#service-bound, why the service stays on h11.)
HEAD_LIMIT = 16 * 1024


def test_a_request_head_past_the_limit_is_refused_and_its_connection_closed():
    """A client cannot keep sending header lines (all kept in memory) until the header timeout: however the head
    passes the limit (many lines, one line that never ends, a long target), it is refused 400 and closed."""
    with Running(header_timeout_s=30) as srv:
        fits = srv.connect()
        fits.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (HEAD_LIMIT - 200) + b"\r\n\r\n")
        assert read_response(fits, until=b"\r\n\r\nok").startswith(b"HTTP/1.1 200")
        refused = []
        for head in (b"GET /a HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Pad-%d: " % i + b"a" * (HEAD_LIMIT // 3)
                                                                     + b"\r\n" for i in range(4)),
                     b"GET /a HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * (HEAD_LIMIT + 1),
                     b"GET /" + b"a" * (HEAD_LIMIT + 1)):
            c = srv.connect()
            c.sendall(head)  # never the blank line: refused while the head still comes
            refused.append(read_response(c))  # to the end: the server closes it
            c.close()
        assert all(r.startswith(b"HTTP/1.1 400") and b"connection: close" in r.lower() for r in refused), refused
        fits.close()


def test_a_body_still_coming_after_its_early_response_does_not_hold_the_connection():
    """An early response (a refusal before the body is read), then the body trickles: each byte cancels uvicorn's
    keep-alive timer, so the header timer, armed when the response completed, closes the connection."""
    with Running(header_timeout_s=0.3) as srv:
        s = srv.connect()
        s.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        assert read_response(s, until=b"\r\n\r\nok").startswith(b"HTTP/1.1 200")
        s.sendall(b"x")  # and never the rest
        s.settimeout(3)  # well before the keep-alive timer (5 s), were it still armed
        assert s.recv(1024) == b"", "a connection whose body trickled after its response was kept"
        s.close()


def test_an_endless_trailer_is_refused_like_an_endless_header():
    """A chunked body's trailer lines are bounded as a head's are, while the app still reads the body."""
    first_chunk = threading.Event()

    async def reads_the_body(scope, receive, send):
        if scope["type"] != "http":
            return
        await read_body(receive, first_chunk.set)
        await respond(send, b"ok")

    with Running(app=reads_the_body, header_timeout_s=30) as srv:
        s = srv.connect()
        s.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-T: a")
        assert first_chunk.wait(10)
        s.sendall(b"a" * (HEAD_LIMIT + 1))  # the trailer's value, never ended
        assert read_response(s).startswith(b"HTTP/1.1 400")
        s.close()
        fine = srv.connect()  # a chunked body with a short trailer is read and answered
        fine.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
                     b"X-T: 1\r\n\r\n")
        assert read_response(fine, until=b"\r\n\r\nok").startswith(b"HTTP/1.1 200")
        fine.close()


def test_a_request_pipelined_behind_a_large_body_is_answered_not_refused():
    """A read that ends one request's head, carries its body and begins the next request's head: both answered."""
    with Running(header_timeout_s=30) as srv:
        s = srv.connect()
        s.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\n")
        # the rest of its head, its body and the next request's head begun, in one write
        s.sendall(b"Content-Length: 20000\r\n\r\n" + b"a" * 20000 + b"GET /b HTTP/1.1\r\nHost: x\r\n")
        assert read_response(s, until=b"\r\n\r\nok").startswith(b"HTTP/1.1 200")
        s.sendall(b"\r\n")  # the next request's head ends
        assert read_response(s, until=b"\r\n\r\nok").startswith(b"HTTP/1.1 200")
        s.close()


def test_a_request_that_asks_to_switch_protocols_is_answered_over_http_1_1_body_and_all():
    """The service switches no protocol: a request with ``Connection: upgrade`` (h2c here) is answered as any other,
    its body read as its body, never as the next request (uvicorn's httptools protocol would: uvicorn#2722)."""
    async def echo(scope, receive, send):  # answers with its path and the bytes of body it read
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        await respond(send, f"{scope['path']}:{len(body)};".encode())

    with Running(app=echo, header_timeout_s=30) as srv:
        s = srv.connect()
        s.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                  b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: 26\r\n\r\n"
                  b"GET /smuggled HTTP/1.1\r\n\r\n")
        answer = read_response(s, until=b";")
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n/predict:26;")  # its body, whole
        s.sendall(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection goes on: the next answer is /b's
        assert read_response(s, until=b";").endswith(b"\r\n\r\n/b:0;")
        s.close()


def test_a_request_over_the_connection_cap_gets_503_but_the_health_probes_are_answered():
    with Running(max_connections=2, header_timeout_s=30) as srv:
        held = [srv.connect(), srv.connect()]
        deadline = time.monotonic() + 10
        while len(srv.server.server_state.connections) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for path, status in ((b"/predict", b"503"), (b"/health/live", b"200"), (b"/v2/health/ready", b"200"),
                             (b"/healthz", b"503"), (b"/v1/models", b"503"), (b"/health/other", b"503"),
                             (b"/health/../predict", b"503")):  # the probes by exact path, never a prefix
            third = srv.connect()
            third.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_response(third).startswith(b"HTTP/1.1 " + status), path
            third.close()
        for s in held:
            s.close()
