"""Service overhead and micro-batching, measured in one run on the real model.

    python -m benchmarks.service_latency [--artifact artifacts/default] [--requests 40]
        [--output benchmarks/results/service_latency.json]

1. Latency: the bare predictor answering one question at a time in this process, against POST /predict
   to a real uvicorn process on loopback (one client), on the same questions: p50/p99 and their ratios.
   Beside them the mean request time and the service's own model time per request (``ibedl_forward_seconds``),
   which tell HTTP's share from the model call's, and both processes' voluntary context switches per question
   (thousands where torch's OpenMP workers sleep between parallel regions, see ibedl.engine.engine.Engine).
2. Throughput with 8 and 32 concurrent clients against the service (micro-batched), against the bare
   predictor on batches of the same sizes: answered questions/s, ratios, and the statuses of the refused.
Latencies are paired (each question through the bare predictor, then through HTTP); the idle side
uses no CPU while the other runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import cpu_features, paired_ratio, voluntary_context_switches, write_result
from benchmarks.service_process import ServiceProcess  # the same harness the end-to-end tests use
from ibedl.core.predictor import Predictor
from ibedl.training.data import load_dataset


def pct(values, q):
    return float(np.percentile(values, q))


def forward_seconds(metrics: str) -> float:
    """The service's total model time so far: ``ibedl_forward_seconds_sum`` of its Prometheus text."""
    return sum(sample.value for family in text_string_to_metric_families(metrics) for sample in family.samples
               if sample.name == "ibedl_forward_seconds_sum")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--output", default="benchmarks/results/service_latency.json")
    args = parser.parse_args(argv)
    questions = load_dataset("sciq", "validation", limit=max(args.requests, 64), seed=3)
    payloads = [{"question": q.question, "options": list(q.options), "context": q.context} for q in questions]

    predictor = Predictor.from_artifact(args.artifact)
    # the bare predictor above is torch: the service runs torch too, so the same arithmetic on both sides (the
    # service's own model time, recorded below, tells HTTP and batching from the model call)
    server = ServiceProcess(args.artifact, {"IBEDL_MAX_BATCH_SIZE": "32", "IBEDL_MAX_WAIT_MS": "10",
                                            "IBEDL_BACKEND": "torch"})
    try:
        server.wait_ready()
        with httpx.Client(timeout=120) as client:
            predictor.predict(questions[:2])  # warm-up both
            client.post(server.url + "/predict", json=payloads[0])
            bare, http = [], []
            switches = {"bare": 0, "service": 0}
            forward_before = forward_seconds(client.get(server.url + "/metrics").text)
            # Paired: the same question through the bare predictor, then through HTTP. The idle server
            # uses no CPU while the predictor runs, and the other way round.
            for q, p in zip(questions[: args.requests], payloads[: args.requests], strict=True):
                before = voluntary_context_switches()
                start = time.perf_counter()
                predictor.predict([q], truncate_context=False)
                bare.append(time.perf_counter() - start)
                switches["bare"] += voluntary_context_switches() - before
                before = voluntary_context_switches(server.proc.pid)
                start = time.perf_counter()
                client.post(server.url + "/predict", json=p).raise_for_status()
                http.append(time.perf_counter() - start)
                switches["service"] += voluntary_context_switches(server.proc.pid) - before
            forward = forward_seconds(client.get(server.url + "/metrics").text) - forward_before
        bare_batch = {}
        for size in (8, 32):
            start = time.perf_counter()
            for i in range(0, 64, size):
                predictor.predict(questions[i : i + size], truncate_context=False)
            bare_batch[size] = 64 / (time.perf_counter() - start)
        served = {}
        for clients in (8, 32):
            def call(p):
                with httpx.Client(timeout=300) as c:
                    return c.post(server.url + "/predict", json=p).status_code

            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                codes = list(pool.map(call, payloads[:64]))
            # answered questions only: a request the service refuses (503, admission) is not throughput
            served[clients] = {"questions_per_s": codes.count(200) / (time.perf_counter() - start),
                               "non_200": sum(c != 200 for c in codes),
                               "statuses": {str(c): codes.count(c) for c in sorted(set(codes))}}
        metrics = httpx.get(server.url + "/metrics").text
        batches = [line for line in metrics.splitlines()
                   if line.startswith(("ibedl_batch_size_sum", "ibedl_batch_size_count"))]
    finally:
        server.stop()
    sequential = 1.0 / float(np.mean(bare))
    result = {
        "artifact": args.artifact,
        "artifact_version": predictor.manifest.version if predictor.manifest else None,
        "cpu": cpu_features(),
        "requests": args.requests,
        "latency_s": {
            "bare_predictor": {"p50": pct(bare, 50), "p99": pct(bare, 99)},
            "service": {"p50": pct(http, 50), "p99": pct(http, 99)},
            "service_over_bare": {"p50": pct(http, 50) / pct(bare, 50), "p99": pct(http, 99) / pct(bare, 99)},
            # the service's own model time per request (ibedl_forward_seconds): tells HTTP from the model call
            "service_mean": float(np.mean(http)),
            "service_model_mean": forward / len(http),
            "bare_predictor_mean": float(np.mean(bare)),
            # request time over the bare predictor's, question by question: the ratio of means, paired interval
            "service_over_bare_mean": paired_ratio(http, bare),
            "per_question": {"bare_predictor": bare, "service": http},
        },
        # each process's threads waiting, per question of the paired phase (benchmarks.common)
        "voluntary_context_switches_per_question": {k: v / len(http) for k, v in switches.items()},
        "throughput_questions_per_s": {
            str(c): {"service": served[c]["questions_per_s"], "bare_batched": bare_batch[c],
                     "service_over_bare": served[c]["questions_per_s"] / bare_batch[c], "non_200": served[c]["non_200"],
                     "statuses": served[c]["statuses"]}
            for c in (8, 32)
        },
        "bare_sequential_questions_per_s": sequential,
        "service_batch_size_metrics": batches,
    }
    write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
