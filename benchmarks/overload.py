"""The service under overload and shutdown, against a real uvicorn process on loopback (the default adapter).

    python -m benchmarks.overload [--artifact artifacts/default] [--duration 40] \
        [--output benchmarks/results/overload.json]

Phases, each bounded in time:
1. **Unloaded**: 12 SciQ validation questions (with passage) one at a time: p50 latency; then 16 closed-loop
   clients for a third of ``--duration``: the throughput X (questions/s) at saturation.
2. **One large batch**: the largest /predict/batch of ~950-token questions (SciQ passages joined) the service
   admits (within the token budget and its deadline, from its own estimate and overrun factor), and 2 s later
   one small question: its latency against twice its unloaded latency plus one forward pass of
   ``IBEDL_MAX_BATCH_TOKENS`` tokens; then 32 such questions in one request (over the token budget: 413 at once).
   It runs before the overload phases, which leave admission stricter for a while.
3. **Closed loop at 1x and 3x capacity** for ``--duration`` seconds each. Capacity, in clients, is what the
   service can answer inside its request timeout at throughput X: ``floor(X * timeout / margin)``. Clients
   send one question, wait for the answer, and send the next; on a 503 they wait its ``Retry-After``.
4. **Open burst**: 300 /predict at once, no retries.
5. **SIGTERM with 80 requests sent**: once each is in flight or answered, SIGTERM; the status of each and the
   exit code.

For every phase: status counts, p50/p99 latency of the accepted requests (200), the share of accepted
requests that timed out (504 or no answer), the latency of refusals (503 should be immediate), and the
service's resident memory before and after. The machine's cores are shared with the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import cpu_features, write_result
from benchmarks.service_process import ServiceProcess
from ibedl.training.data import load_dataset


def pct(values, q) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


class Log:
    """Outcomes of one phase: (status, seconds) per request attempt."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[int, float]] = []

    def summary(self, timeout_s: float) -> dict:
        codes = Counter(code for code, _ in self.outcomes)
        ok = [s for code, s in self.outcomes if code == 200]
        refused = [s for code, s in self.outcomes if code == 503]
        timed_out = codes.get(504, 0) + codes.get(0, 0)  # 0: no answer (transport error or client timeout)
        accepted = len(ok) + timed_out
        return {
            "requests": len(self.outcomes),
            "status": {str(k): v for k, v in sorted(codes.items())},
            "accepted_p50_s": pct(ok, 50),
            "accepted_p99_s": pct(ok, 99),
            "accepted_over_timeout": sum(s > timeout_s for s in ok),
            "accepted_timed_out_share": round(timed_out / accepted, 4) if accepted else None,
            "refused_p50_s": pct(refused, 50),
            "refused_p99_s": pct(refused, 99),
        }


async def post(client: httpx.AsyncClient, url: str, body: dict, log: Log | None = None) -> httpx.Response | None:
    start = time.perf_counter()
    try:
        r = await client.post(url, json=body)
    except httpx.HTTPError:
        r = None
    if log is not None:
        log.outcomes.append((r.status_code if r is not None else 0, time.perf_counter() - start))
    return r


async def closed_loop(url: str, payloads: list[dict], clients: int, seconds: float, log: Log) -> None:
    """``clients`` clients, each sending the next question when its last is answered, for ``seconds``;
    a 503 is retried after its Retry-After (as a well-behaved client would)."""
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(k: int) -> None:
            i = k
            while time.monotonic() < end:
                r = await post(client, url + "/predict", payloads[i % len(payloads)], log)
                i += clients
                if r is not None and r.status_code == 503:
                    wait = float(r.headers.get("retry-after", "1"))
                    await asyncio.sleep(max(0.0, min(wait, end - time.monotonic())))

        await asyncio.gather(*(one(k) for k in range(clients)))


async def burst(url: str, payloads: list[dict], n: int, log: Log) -> None:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(post(client, url + "/predict", payloads[i % len(payloads)], log) for i in range(n)))


def long_questions(questions, tokens_each: int = 950) -> list[dict]:
    """Questions whose passage is several SciQ passages joined, about ``tokens_each`` prompt tokens each
    (4 characters a token, roughly, for SmolLM2's tokenizer on English)."""
    passages = [q.context for q in questions if q.context]
    out = []
    for i, q in enumerate(questions):
        text, j = "", i
        while len(text) < 4 * tokens_each - 400:
            text += passages[j % len(passages)] + " "
            j += 1
        out.append({"question": q.question, "options": list(q.options), "context": text.strip()})
    return out


async def batch_and_small(url: str, batch: list[dict], small: dict, log_batch: Log, log_small: Log) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        big = asyncio.ensure_future(post(client, url + "/predict/batch", {"items": batch}, log_batch))
        await asyncio.sleep(2.0)
        await post(client, url + "/predict", small, log_small)
        await big


async def sigterm_under_load(server: ServiceProcess, payloads: list[dict], n: int, log: Log) -> dict:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = [asyncio.ensure_future(post(client, server.url + "/predict", payloads[i % len(payloads)], log))
                 for i in range(n)]
        deadline = time.monotonic() + 20
        inflight = 0.0
        while time.monotonic() < deadline:
            try:
                inflight = metric((await client.get(server.url + "/metrics")).text, "ibedl_inflight_requests")
            except httpx.HTTPError:
                break
            if inflight + len(log.outcomes) >= n:  # every request is in flight or already answered
                break
            await asyncio.sleep(0.05)
        answered_before = len(log.outcomes)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
    code = await asyncio.to_thread(server.proc.wait, 60)
    return {"inflight_at_sigterm": inflight, "answered_before_sigterm": answered_before, "exit_code": code}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of each closed-loop phase")
    parser.add_argument("--burst", type=int, default=300)
    parser.add_argument("--output", default="benchmarks/results/overload.json")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.burst < 1:
        parser.error(f"--duration must be > 0 and --burst >= 1, got {args.duration} and {args.burst}")

    questions = load_dataset("sciq", "validation", limit=400, seed=5)
    payloads = [{"question": q.question, "options": list(q.options), "context": q.context} for q in questions]
    from ibedl.serve.settings import Settings

    settings = Settings()
    timeout_s, margin = settings.request_timeout_s, settings.admission_margin
    result: dict = {"command": "python -m benchmarks.overload " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "artifact": args.artifact, "request_timeout_s": timeout_s, "admission_margin": margin,
                    "max_batch_tokens": settings.max_batch_tokens, "max_request_tokens": settings.max_request_tokens,
                    "max_connections": settings.max_connections, "cpu": cpu_features(), "phases": {}}
    server = ServiceProcess(args.artifact, {"IBEDL_LOG_LEVEL": "warning"})
    try:
        server.wait_ready()
        pid = server.proc.pid
        result["rss_mib_ready"] = rss_mib(pid)
        result["backend"] = httpx.get(f"{server.url}/v1/models").json()["data"][0]["backend"]["name"]

        # 1. Unloaded latency and saturated throughput.
        async def unloaded():
            log = Log()
            async with httpx.AsyncClient(timeout=120) as client:
                for body in payloads[:12]:
                    await post(client, server.url + "/predict", body, log)
            return log

        single = asyncio.run(unloaded())
        p50 = pct([s for _, s in single.outcomes[2:]], 50)
        sat = Log()
        asyncio.run(closed_loop(server.url, payloads[12:], 16, args.duration / 3, sat))
        answered = sum(code == 200 for code, _ in sat.outcomes)
        throughput = answered / (args.duration / 3)
        capacity = max(1, math.floor(throughput * timeout_s / margin))
        result["unloaded"] = {"p50_s": p50, "throughput_qps": round(throughput, 3), "capacity_clients": capacity}
        print(f"unloaded p50 {p50} s, throughput {throughput:.2f} q/s, capacity {capacity} clients", file=sys.stderr)

        # 2. The largest batch (before the overload phases: their overrun factor would make admission stricter) of
        #    ~950-token questions the service admits, and a small question 2 s later; then 32 such questions in one
        #    request (over the token budget).
        long = long_questions(questions[:64])
        with httpx.Client(timeout=120) as client:
            client.post(server.url + "/predict", json=long[0])  # the estimate sees a long question once
            text = client.get(server.url + "/metrics").text
            per_token, overrun = metric(text, "ibedl_seconds_per_token"), metric(text, "ibedl_admission_overrun")
        tokens_each = 950
        items = max(1, min(settings.max_request_tokens // tokens_each,
                           int(0.8 * timeout_s / (margin * overrun * per_token * tokens_each))))
        small = payloads[0]
        log_batch, log_small = Log(), Log()
        asyncio.run(batch_and_small(server.url, long[:items], small, log_batch, log_small))
        over = Log()
        asyncio.run(batch_and_small(server.url, long[:32], small, over, Log()))
        small_s = log_small.outcomes[0][1]
        one_pass = per_token * settings.max_batch_tokens
        result["phases"]["large_batch"] = {
            "items": items, "seconds_per_token_before": per_token, "admission_overrun_before": overrun,
            "batch": log_batch.summary(timeout_s),
            "small_latency_s": round(small_s, 3), "small_unloaded_p50_s": p50, "one_forward_pass_s": round(one_pass, 3),
            "bound_s": round(2 * p50 + one_pass, 3), "within_bound": small_s <= 2 * p50 + one_pass,
            "batch_32_items": over.summary(timeout_s), "rss_mib_after": rss_mib(pid)}
        print("large_batch", json.dumps(result["phases"]["large_batch"]), file=sys.stderr)
        time.sleep(timeout_s / 3)

        # 3. Closed loop at 1x and 3x capacity.
        for name, clients in (("closed_1x", capacity), ("closed_3x", 3 * capacity)):
            log = Log()
            asyncio.run(closed_loop(server.url, payloads, clients, args.duration, log))
            result["phases"][name] = {"clients": clients, "seconds": args.duration, **log.summary(timeout_s),
                                      "rss_mib_after": rss_mib(pid)}
            print(name, json.dumps(result["phases"][name]), file=sys.stderr)
            time.sleep(timeout_s / 3)  # let the last answers drain

        # 4. Open burst.
        log = Log()
        asyncio.run(burst(server.url, payloads, args.burst, log))
        result["phases"]["burst"] = {"requests": args.burst, **log.summary(timeout_s), "rss_mib_after": rss_mib(pid)}
        print("burst", json.dumps(result["phases"]["burst"]), file=sys.stderr)
        time.sleep(timeout_s / 3)

        # 5. SIGTERM with 80 in flight.
        log = Log()
        outcome = asyncio.run(sigterm_under_load(server, payloads, 80, log))
        result["phases"]["sigterm_80"] = {**outcome, **log.summary(timeout_s)}
        print("sigterm_80", json.dumps(result["phases"]["sigterm_80"]), file=sys.stderr)
    finally:
        server.stop()
    write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
