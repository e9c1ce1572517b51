"""A closed-loop HTTP load client light enough not to be the bound of what it measures: kept-alive HTTP/1.1
connections on asyncio streams, framed by h11 (uvicorn's and httpcore's parser), each sending its next request once
the last is answered. About 0.25 ms of CPU a request on the 2-core Xeon, where httpx's client took 8.8 ms and bounded
the service's answers/s at about 110 (``benchmarks.service_bound``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

TIMEOUT_S = 120.0  # one request's longest wait for its whole answer; then it counts as failed (TimeoutError)


async def post(reader, writer, connection, target: str, body: bytes,
               headers: Sequence[tuple[str, str]] = ()) -> tuple[int, bytes]:
    """One ``POST`` of ``body`` (JSON) to ``target`` on a kept-alive connection (``connection``: an
    ``h11.Connection(h11.CLIENT)`` in its idle state); its status and body, once the whole answer is read. The
    connection is left idle for the next request, unless the answer closed it (``Connection: close``).

    Raises:
        ConnectionError: the server closed the connection before the answer's end.
    """
    import h11

    head = [("Host", "127.0.0.1"), ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            *headers]
    writer.write(connection.send(h11.Request(method="POST", target=target, headers=head))
                 + connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage()))
    status, chunks, closed = 0, [], False
    while True:
        try:
            event = connection.next_event()
        except h11.RemoteProtocolError as e:  # the close came before the answer's end
            if closed:
                raise ConnectionError("the server closed the connection before its answer") from e
            raise
        if event is h11.NEED_DATA:
            data = await reader.read(65536)
            closed = not data
            connection.receive_data(data)  # b"" at the close: an answer the close ends, ends
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("the server closed the connection before its answer")
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            if connection.our_state is h11.DONE and connection.their_state is h11.DONE:  # kept alive
                connection.start_next_cycle()
            return status, b"".join(chunks)  # else (Connection: close) the caller opens another


async def send_all(port: int, target: str, bodies: Sequence[bytes], clients: int,
                   headers: Sequence[tuple[str, str]] = (), until: float | None = None,
                   clock: Callable[[], float] = time.monotonic) -> list[tuple[int, float, bytes | str] | None]:
    """``bodies`` sent as ``POST`` to ``target`` on 127.0.0.1:``port`` by ``clients`` concurrent connections, each
    taking the next body once its last is answered. Per body, in order: (status, seconds, the answer's body), or
    (0, seconds, the error's type) when its connection failed or it took over :data:`TIMEOUT_S` (the connection is
    then opened again for the next), or None when it was not sent because ``clock()`` had passed ``until``."""
    import h11

    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    results: list[tuple[int, float, bytes | str] | None] = [None] * len(bodies)
    queue = iter(enumerate(bodies))  # one shared queue

    async def one() -> None:
        stream = None
        try:
            for i, body in queue:
                if until is not None and clock() > until:
                    return  # the others see it too: what is left is not sent
                start = time.perf_counter()
                try:
                    async with asyncio.timeout(TIMEOUT_S):  # connecting included
                        if stream is None:
                            reader, writer = await asyncio.open_connection("127.0.0.1", port)
                            stream = reader, writer, h11.Connection(h11.CLIENT)
                        status, answer = await post(*stream, target, body, headers)
                    results[i] = status, time.perf_counter() - start, answer
                    if stream[2].our_state is not h11.IDLE:  # the server closed it after its answer
                        stream[1].close()
                        stream = None
                except (OSError, asyncio.TimeoutError, h11.ProtocolError) as e:  # one lost request, not a lost run
                    results[i] = 0, time.perf_counter() - start, type(e).__name__
                    if stream is not None:
                        stream[1].close()
                    stream = None
        finally:
            if stream is not None:
                stream[1].close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return results


__all__ = ["TIMEOUT_S", "post", "send_all"]
