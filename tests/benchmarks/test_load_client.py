"""benchmarks/load_client.py against a real HTTP/1.1 server on loopback (asyncio and h11): every body answered in
order, at most ``clients`` at once, a lost connection one failed request, and nothing sent past the deadline."""

from __future__ import annotations

import asyncio
import json

import h11
import pytest

from benchmarks.load_client import send_all


async def serve(handle):
    """A loopback HTTP/1.1 server whose answer to each POST body is ``await handle(body)``: (status, answer body[,
    "close": then it closes the connection after the answer, saying so]), or None to close the connection without an
    answer. Returns the server and its port."""

    async def connection(reader, writer):
        conn = h11.Connection(h11.SERVER)
        body = b""
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    answer = await handle(body)
                    if answer is None:
                        return
                    status, content, *close = answer
                    headers = [("Content-Length", str(len(content))), *([("Connection", "close")] if close else [])]
                    writer.write(conn.send(h11.Response(status_code=status, headers=headers))
                                 + conn.send(h11.Data(data=content)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    if close:
                        return
                    conn.start_next_cycle()
                    body = b""
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_every_body_is_answered_in_order_by_at_most_clients_at_once():
    state = {"now": 0, "most": 0}

    async def handle(body):
        state["now"] += 1
        state["most"] = max(state["most"], state["now"])
        await asyncio.sleep(0)  # let the other connections in
        state["now"] -= 1
        n = json.loads(body)["n"]
        return (200, json.dumps({"twice": 2 * n}).encode()) if n % 5 else (503, b'{"error": {"type": "busy"}}')

    async def run():
        server, port = await serve(handle)
        async with server:
            return await send_all(port, "/predict", [json.dumps({"n": n}).encode() for n in range(1, 31)], clients=4,
                                  headers=[("Authorization", "Bearer x")])

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [503 if n % 5 == 0 else 200 for n in range(1, 31)]
    assert all(json.loads(answer) == {"twice": 2 * n}
               for n, (status, _, answer) in zip(range(1, 31), results, strict=True) if status == 200)
    assert all(seconds >= 0 for _, seconds, _ in results)
    assert 1 <= state["most"] <= 4


def test_a_closed_connection_fails_its_request_only_and_the_next_one_reconnects():
    async def handle(body):
        return None if json.loads(body)["n"] == 3 else (200, b"{}")

    async def run():
        server, port = await serve(handle)
        async with server:
            return await send_all(port, "/x", [json.dumps({"n": n}).encode() for n in range(6)], clients=1)

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200, 200, 200, 0, 200, 200]
    assert results[3][2] == "ConnectionError"


def test_nothing_is_sent_past_the_deadline_and_clients_are_checked():
    async def handle(body):
        raise AssertionError("nothing should be sent")

    async def run():
        server, port = await serve(handle)
        async with server:
            return await send_all(port, "/x", [b"{}"] * 3, clients=2, until=10.0, clock=lambda: 11.0)

    assert asyncio.run(run()) == [None, None, None]
    with pytest.raises(ValueError, match="clients must be >= 1, got 0"):
        asyncio.run(send_all(1, "/x", [b"{}"], clients=0))


def test_an_answer_that_closes_its_connection_counts_as_answered_and_the_next_one_reconnects():
    """The service's shutdown 503s and its 408 say ``Connection: close``: the answer is the client's (a refusal, not
    a failure), and the next request opens another connection."""
    async def handle(body):
        n = json.loads(body)["n"]
        return (503, b'{"error": {"type": "shutting_down"}}', "close") if n == 2 else (200, b"{}")

    async def run():
        server, port = await serve(handle)
        async with server:
            return await send_all(port, "/x", [json.dumps({"n": n}).encode() for n in range(5)], clients=1)

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200, 200, 503, 200, 200]
    assert json.loads(results[2][2]) == {"error": {"type": "shutting_down"}}
