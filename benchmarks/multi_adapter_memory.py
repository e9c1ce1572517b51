"""Resident memory of the service serving 1 vs 3 adapters on one shared base model (SmolLM2-135M, CPU):
``python -m benchmarks.multi_adapter_memory`` -> benchmarks/results/multi_adapter_memory.json.

Each configuration is a fresh ``python -m ibedl.serve`` process (benchmarks.service_process); VmRSS is read from
/proc/<pid>/status once it is ready and again after 10 requests per adapter."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx

from benchmarks.common import cpu_features, write_result
from benchmarks.service_process import REPO, ServiceProcess

ADAPTERS = ["default", "map", "map-twin"]
QUESTION = {"question": "Which gas do plants take in for photosynthesis?",
            "options": ["oxygen", "carbon dioxide", "nitrogen", "helium"],
            "context": "Plants take in carbon dioxide and give off oxygen."}


def measure(names: list[str], requests: int, log_dir: Path) -> dict:
    proc = ServiceProcess([REPO / "artifacts" / n for n in names], {"IBEDL_THREADS": "2", "IBEDL_BACKEND": "torch"},
                          log_dir / f"{len(names)}.log")
    try:
        proc.wait_ready(300)
        ready = proc.rss_mib()
        for name in names:
            for _ in range(requests):
                r = httpx.post(proc.url + "/predict", json={**QUESTION, "adapter": name}, timeout=60)
                r.raise_for_status()
        return {"adapters": names, "rss_ready_mib": round(ready, 1), "rss_after_requests_mib": round(proc.rss_mib(), 1),
                "requests_per_adapter": requests}
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_adapter_memory",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10, help="requests per adapter before the second reading")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "multi_adapter_memory.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(ADAPTERS[:1], args.requests, Path(tmp)), measure(ADAPTERS, args.requests, Path(tmp))]
    one, three = runs
    write_result(args.output, {
        "command": "python -m benchmarks.multi_adapter_memory",
        "setup": "torch float32 trunk, IBEDL_THREADS=2", "cpu": cpu_features(),
        "runs": runs,
        "extra_mib_for_two_more_adapters": round(three["rss_after_requests_mib"] - one["rss_after_requests_mib"], 1),
        "note": "one base model in the process whatever the number of adapters: each more adapter adds only its "
                "LoRA weights and head; three single-adapter services would hold three times the first run's RSS",
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
