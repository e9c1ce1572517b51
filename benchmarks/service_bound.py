"""What bounds the HTTP service's answers/s when the trunk costs nothing (as on a GPU that answers faster than the
host), and which of its threads:

    python -m benchmarks.service_bound [--artifact artifacts/default] [--clients 64] [--requests 3000] [--items 1]
        [--check-threads N] [--no-gc-freeze] [--dataset sciq] [--output benchmarks/results/service_bound_cpu.json]

The service (``ibedl.serve``'s app on uvicorn, as ``python -m ibedl.serve`` configures it, with an API token, its JSON
log lines, the access lines among them, written to a file) runs in this process on a loopback port, serving the
artifact's predictor (torch backend) with its trunk replaced by ``benchmarks.check_threads``' stand-in, under the
scheduling a GPU serves with (passes of up to 64 questions, padded freely). A client in a process of its own
(``benchmarks.load_client``) keeps ``--clients`` connections, each sending its next request once answered:
``--requests`` requests of ``--items`` distinct SciQ training questions with their passages (or ``--dataset``'s), whole
under the service's token limit (``POST /predict`` for one, ``POST /predict/batch`` for more), after a first tenth
untimed. Recorded: answers/s and p50/p99 latency of a request as the client got them, the statuses, the client's CPU
time a request, and the service's CPU time an answer on each kind of thread: the event loop (uvicorn's: HTTP, the
request's parsing and validation, scheduling, the answer's building and JSON, the observers), the request-checking
threads (``IBEDL_CHECK_THREADS``, default as the service's), the model's thread, and the others (``other: native``:
threads Python did not start, torch's and the tokenizers'). From those, the answers/s each kind would allow at full use
(the check pool's as if its threads ran in parallel), and the lowest (``bound_answers_per_s``, ``bound_by``): the
service's bound on a machine with a core for each thread and one for the client. The client shares this machine's cores:
answers/s is what this machine gave, the CPU times what the service's code costs. Also recorded: the cyclic garbage
collector's collections over the timed requests, their count and pauses by generation, and the objects the service
froze once ready (``IBEDL_GC_FREEZE``, on unless ``--no-gc-freeze``: it keeps the full collections short).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import multiprocessing
import os
import sys
import tempfile
import threading
import time

import numpy as np

from benchmarks.check_threads import SERVE_AS_ON_A_GPU, stand_in_loader
from benchmarks.common import cpu_by_thread_kind, cpu_features, served_questions, write_result
from benchmarks.load_client import send_all

TOKEN = "service-bound-benchmark-token"  # the API token the service requires here (any value; loopback only)


def client(port: int, target: str, bodies: list[dict], clients: int) -> dict:
    """In a process of its own: ``bodies`` sent as ``POST`` to ``target`` by ``clients`` concurrent kept-alive
    connections (benchmarks.load_client), each its next once answered; wall seconds, the process's CPU seconds,
    each request's latency (seconds) and status counts (0: no answer)."""
    import json

    encoded = [json.dumps(body).encode() for body in bodies]
    start, cpu = time.perf_counter(), time.process_time()
    sent = asyncio.run(send_all(port, target, encoded, clients, [("Authorization", f"Bearer {TOKEN}")]))
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    statuses: dict[str, int] = {}
    for status, _, _ in sent:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"seconds": seconds, "cpu_s": cpu_s, "latencies": [took for _, took, _ in sent], "statuses": statuses}


def cpu_by_role(server_thread: int) -> dict[str, float]:
    """CPU seconds this process's threads have used, summed by role: the server's event loop (``server_thread``'s
    native id), the check threads, the model's thread, and the others by their Python name without its number
    (``other: asyncio``, ...; ``other: native`` for threads Python did not start: torch's, the tokenizers')."""
    roles = {"event_loop": "event_loop", "ibedl-check": "check", "ibedl-model": "model"}
    out = {"event_loop": 0.0, "check": 0.0, "model": 0.0}
    for kind, seconds in cpu_by_thread_kind({server_thread: "event_loop"}).items():
        role = roles.get(kind, f"other: {kind}")
        out[role] = out.get(role, 0.0) + seconds
    return out


@contextlib.contextmanager
def service_logging(settings):
    """The service's log lines (``ibedl.serve.logs.configure``, as ``python -m ibedl.serve`` sets it up) written to
    a file in a temporary directory; on leaving, the file and directory go and the root and uvicorn loggers are as
    they were."""
    import logging

    from ibedl.serve import logs

    loggers = (logging.getLogger(), *(logging.getLogger(n) for n in ("uvicorn", "uvicorn.error")))
    saved = [(logger, logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    with tempfile.TemporaryDirectory(prefix="service-bound-") as directory, \
            open(f"{directory}/service.log", "w") as log_file:
        logs.configure(settings.log_level, settings.log_format).setStream(log_file)
        try:
            yield
        finally:
            for logger, handlers, level, propagate in saved:
                logger.handlers[:], logger.propagate = handlers, propagate
                logger.setLevel(level)


class Collections:
    """The cyclic garbage collector's collections while in a ``with`` block, in any thread: pauses by generation."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start: float | None = None

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:  # a collection holds the GIL: starts and stops alternate
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.pauses[info["generation"]].append(time.perf_counter() - self._start)
            self._start = None

    def summary(self) -> dict:
        """Per generation: collections, their seconds in all, the longest in ms."""
        return {str(g): {"collections": len(p), "seconds": sum(p), "longest_ms": 1e3 * max(p, default=0.0)}
                for g, p in self.pauses.items()}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, by linear interpolation (numpy's, as the GPU check's serve
    summary takes it)."""
    return float(np.percentile(values, q))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service_bound", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--clients", type=int, default=64, help="concurrent connections (default 64)")
    parser.add_argument("--requests", type=int, default=3000, help="timed one-question requests (default 3000)")
    parser.add_argument("--items", type=int, default=1, help="questions a request: 1 sends POST /predict, more "
                        "POST /predict/batch (default 1)")
    parser.add_argument("--check-threads", type=int, default=None, help="IBEDL_CHECK_THREADS (default: the "
                        "service's own default on this machine)")
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                        help="IBEDL_GC_FREEZE (default on, as the service)")
    parser.add_argument("--dataset", default="sciq", help="a built-in dataset's training questions (default sciq)")
    parser.add_argument("--output", default="benchmarks/results/service_bound_cpu.json")
    args = parser.parse_args(argv)
    for flag, value in (("--clients", args.clients), ("--requests", args.requests), ("--items", args.items),
                        ("--check-threads", args.check_threads)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    import torch
    import uvicorn

    from benchmarks.service_process import bound_socket
    from ibedl.engine.heap import HeapFreezer
    from ibedl.serve.app import create_app
    from ibedl.serve.server import uvicorn_config
    from ibedl.serve.settings import Settings

    settings = Settings(artifact=args.artifact, device="cpu", backend="torch", backend_switching=False,
                        api_token=TOKEN, check_threads=args.check_threads, grpc=False, log_format="json",
                        gc_freeze=args.gc_freeze, **SERVE_AS_ON_A_GPU)
    with service_logging(settings):
        app = create_app(settings, stand_in_loader())
        sock = bound_socket()
        server = uvicorn.Server(uvicorn_config(app, settings))  # on ``sock``'s port
        app.state.service.server = server
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="service", daemon=True)
        thread.start()
        port = sock.getsockname()[1]
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: none of this process's threads
        try:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                engine = app.state.service.engine
                end = time.monotonic() + 300
                while not engine.ready:  # loading: the stand-in loads the base model and the adapter
                    if time.monotonic() > end or not thread.is_alive():
                        print(f"error: the service did not get ready: {engine.reason}", file=sys.stderr)
                        return 1
                    time.sleep(0.1)
                predictor = next(iter(engine.runtimes.values())).predictor
                warm = max(1, args.requests // 10)
                try:
                    questions = served_questions(predictor.tokenizer, predictor.template, settings.max_tokens,
                                                 args.dataset, (warm + args.requests) * args.items,
                                                 "fewer --requests or --items")
                except ValueError as e:
                    parser.error(str(e))
                items = [{"question": q.question, "options": list(q.options), **({"context": q.context}
                                                                                  if q.context else {})}
                         for q in questions]
                target = "/predict" if args.items == 1 else "/predict/batch"
                bodies = items if args.items == 1 else [{"items": items[i:i + args.items]}
                                                        for i in range(0, len(items), args.items)]
                pool.submit(client, port, target, bodies[:warm], args.clients).result()  # every thread's first use
                before = cpu_by_role(thread.native_id)
                with Collections() as collections:
                    got = pool.submit(client, port, target, bodies[warm:], args.clients).result()
                used = {role: seconds - before.get(role, 0.0)
                        for role, seconds in cpu_by_role(thread.native_id).items()}
                frozen = sum(o.frozen for o in engine.observers if isinstance(o, HeapFreezer))  # done by the first
                # request: the engine freezes on its loop as it becomes ready
        finally:
            server.should_exit = True
            thread.join(60)
            sock.close()
    answered = got["statuses"].get("200", 0) * args.items
    per_answer = {role: 1e3 * seconds / max(answered, 1) for role, seconds in used.items()}
    threads = settings.check_threads  # the check pool's bound: if its threads ran in parallel (the tokenizer's
    # Rust half releases the GIL, the Python around it does not)
    # answers/s each kind of thread would allow at full use; None where the run was too short for its clock ticks
    bounds = {role: 1e3 * n / per_answer[role] if per_answer[role] > 0 else None
              for role, n in (("event_loop", 1), ("model", 1), ("check", threads))}
    measured = {role: bound for role, bound in bounds.items() if bound is not None}
    result = {"artifact": args.artifact, "dataset": args.dataset, "clients": args.clients, "requests": args.requests,
              "items_per_request": args.items,
              "check_threads": threads, "settings": SERVE_AS_ON_A_GPU, "gc_freeze": args.gc_freeze,
              "frozen_objects": frozen, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "device": "cpu",
              "cpu": cpu_features(),
              "torch": torch.__version__, "statuses": got["statuses"],
              "answers_per_s": answered / got["seconds"],
              "latency_ms": {"p50": 1e3 * percentile(got["latencies"], 50),
                             "p99": 1e3 * percentile(got["latencies"], 99)},
              "cpu_ms_per_answer_by_thread": per_answer,
              "client_cpu_ms_per_request": 1e3 * got["cpu_s"] / args.requests,
              "gc_collections": collections.summary(),
              "bound_answers_per_s_by_thread": bounds,
              "bound_answers_per_s": min(measured.values(), default=None),
              "bound_by": min(measured, key=measured.get, default=None)}
    write_result(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
