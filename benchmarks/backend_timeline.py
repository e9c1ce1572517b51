"""``IBEDL_BACKEND=auto`` from an empty backend cache: the real service's timeline to ready and to the fastest backend.

    python -m benchmarks.backend_timeline [--artifact artifacts/default] [--max-seconds 900] [--rate 3] \
        [--memory-limit-mib 2048] [--warm-cache] [--output benchmarks/results/backend_timeline.json]

A fresh ``IBEDL_CACHE_DIR`` whose ``models/`` (the converted base model) links to the shared cache's, and no
``backends/`` (no IR, no cached verdict): the service starts on loopback on the default (``auto``), is polled on
/health/ready, and from readiness on a client sends SciQ test questions one at a time at ``--rate`` per second,
recording each status code, the answering ``adapter.backend`` / ``adapter.calibration`` and the latency, while
GET /v1/models is polled for ``backend.background``. Recorded: seconds to ready, each switch (when, from, to, as the
answers and the background status show it), failed requests, and the peak resident memory of the service
(VmHWM) and of the service with its children (the IR builds), sampled from /proc, also at each step of the
background work. ``--memory-limit-mib`` starts the service inside a memory cgroup with that limit, as a Kubernetes
replica runs (benchmarks.memory_cgroup; needs root and a writable cgroup filesystem), and records what the kernel
counted: the peak charge, the peak anonymous memory (file pages such as memory-mapped IRs are reclaimed under the
limit), and the out-of-memory kills (the IR builds are the killer's first pick: ibedl.core.memory_limit). It ends
when the background work is done (or failed) or ``--max-seconds`` after the start, and stops the service.
``--warm-cache`` starts on the shared cache instead (the IRs and the measurement built ahead, as the image ships
them) and ends a minute after readiness when no background work runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import cpu_features, write_result
from benchmarks.memory_cgroup import MemoryCgroup
from benchmarks.service_process import ServiceProcess
from ibedl.core.base_model import cache_dir
from ibedl.training.data import load_dataset


def proc_kib(pid: int, field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/<pid>/status in KiB; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` (children, grandchildren), read from /proc/<pid>/task/*/children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*") if Path(f"/proc/{p}/task").exists() else []:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            found += kids
            todo += kids
    return found


def switches_seen(answers: list[dict]) -> list[dict]:
    """Where the answering backend changes in a time-ordered list of answers (``t_s``, ``backend``,
    ``calibration``): the first answer on each new backend, with the last one on the old."""
    out, last = [], None
    for a in answers:
        if a.get("backend") is None:
            continue
        if last is not None and a["backend"] != last["backend"]:
            out.append({"from": last["backend"], "to": a["backend"], "last_old_answer_s": last["t_s"],
                        "first_new_answer_s": a["t_s"], "calibration": a["calibration"]})
        last = a
    return out


def latency_summary(seconds: list[float]) -> dict:
    if not seconds:
        return {"n": 0}
    return {"n": len(seconds), "p50_s": float(np.percentile(seconds, 50)), "p99_s": float(np.percentile(seconds, 99)),
            "max_s": float(max(seconds))}


class MemorySampler:
    """Resident memory of the service (``pid``) and its children every half second, and of its cgroup (``group``,
    or None): ``peak`` holds the highest seen, ``now()`` one reading."""

    def __init__(self, pid: int, group: MemoryCgroup | None) -> None:
        self.pid, self.group = pid, group
        self.peak = {"service_rss_kib": 0, "with_children_kib": 0, "children_at_peak": 0, "anon_bytes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[int, int, int]:
        """(the service's resident KiB, with its children's, how many children)."""
        kids = descendants(self.pid)
        own = proc_kib(self.pid, "VmRSS")
        return own, own + sum(proc_kib(k, "VmRSS") for k in kids), len(kids)

    def now(self) -> dict:
        own, total, kids = self._read()
        return {"service_rss_mib": round(own / 1024), "children": kids, "with_children_rss_mib": round(total / 1024),
                **({} if self.group is None else {"cgroup_anon_mib": round(self.group.anon_bytes() / 2**20)})}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        peak = self.peak
        while not self._stop.is_set():
            own, total, kids = self._read()
            peak["service_rss_kib"] = max(peak["service_rss_kib"], own)
            if self.group is not None:
                peak["anon_bytes"] = max(peak["anon_bytes"], self.group.anon_bytes())
            if total > peak["with_children_kib"]:
                peak.update(with_children_kib=total, children_at_peak=kids)
            time.sleep(0.5)


def ask(client: httpx.Client, url: str, payload: dict, start: float) -> dict:
    """POST one question to /predict: when it was sent (s after ``start``), status, latency, and the backend and
    calibration that answered (the body's first 300 characters when refused; the error when it failed)."""
    sent = time.monotonic()
    try:
        r = client.post(url + "/predict", json=payload)
    except httpx.HTTPError as e:
        return {"t_s": sent - start, "status": None, "latency_s": time.monotonic() - sent,
                "error": f"{type(e).__name__}: {e}"}
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    adapter = body.get("adapter", {}) if r.status_code == 200 else {}
    return {"t_s": sent - start, "status": r.status_code, "latency_s": time.monotonic() - sent,
            "backend": adapter.get("backend"), "calibration": adapter.get("calibration"),
            **({} if r.status_code == 200 else {"body": r.text[:300]})}


def requests_summary(answers: list[dict]) -> dict:
    """Sent, answered and failed requests, the first failures, and latency per answering backend and overall."""
    failed = [a for a in answers if a["status"] != 200]
    ok = [a for a in answers if a["status"] == 200]
    by_backend: dict = {}
    for a in ok:
        by_backend.setdefault(a["backend"], []).append(a["latency_s"])
    return {"sent": len(answers), "ok": len(ok), "failed": len(failed), "failed_detail": failed[:20],
            "latency_by_backend": {k: latency_summary(v) for k, v in by_backend.items()},
            "latency_all": latency_summary([a["latency_s"] for a in ok])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second at most (one at a time)")
    parser.add_argument("--questions", type=int, default=500, help="SciQ test questions cycled through")
    parser.add_argument("--memory-limit-mib", type=int, default=None,
                        help="run the service in a memory cgroup with this limit (a replica's: 2048)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="start on the shared cache (IRs built ahead, as the image ships them), not an empty one")
    parser.add_argument("--output", default="benchmarks/results/backend_timeline.json")
    args = parser.parse_args(argv)
    if args.memory_limit_mib is not None and args.memory_limit_mib <= 0:
        raise SystemExit(f"--memory-limit-mib must be > 0, got {args.memory_limit_mib}")
    if args.rate <= 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")
    shared = cache_dir()
    if not (shared / "models").is_dir():
        raise SystemExit(f"no converted base model under {shared / 'models'}: start the service once first")
    questions = load_dataset("sciq", "test", limit=args.questions, seed=0)
    payloads = [{"question": q.question, "options": list(q.options), "context": q.context} for q in questions]

    with tempfile.TemporaryDirectory(prefix="ibedl-timeline-") as tmp:
        fresh = Path(tmp) / "cache"
        fresh.mkdir()
        (fresh / "models").symlink_to(shared / "models")  # the base model converted; no backends/ at all
        env = {"IBEDL_CACHE_DIR": str(shared if args.warm_cache else fresh), "IBEDL_BACKEND": "auto"}
        env.pop("IBEDL_BACKEND_SWITCHING", None)
        os.environ.pop("IBEDL_BACKEND_SWITCHING", None)
        try:
            group = MemoryCgroup(args.memory_limit_mib * 2**20) if args.memory_limit_mib else None
        except OSError as e:
            raise SystemExit(str(e)) from None
        start = time.monotonic()
        server = ServiceProcess(args.artifact, env, log_path=Path(tmp) / "service.log",
                                preexec_fn=None if group is None else group.preexec)
        pid = server.proc.pid
        sampler = MemorySampler(pid, group)
        sampler.start()
        answers, background, ready_s, hwm_kib, error = [], [], None, 0, None
        try:
            server.wait_ready(timeout=args.max_seconds)
            ready_s = time.monotonic() - start
            client = httpx.Client(timeout=120)
            deadline, last_poll, i, state = start + args.max_seconds, 0.0, 0, None
            while time.monotonic() < deadline:
                now = time.monotonic()
                if now - last_poll >= 2.0:
                    last_poll = now
                    card = client.get(server.url + "/v1/models").json()["data"][0]["backend"]
                    bg = card.get("background") or {}
                    state = bg.get("state")
                    if not background or background[-1]["state"] != state or \
                            background[-1]["switches"] != len(bg.get("switches", [])):
                        background.append({"t_s": now - start, "state": state, "serving": card.get("name"),
                                           "switches": len(bg.get("switches", [])), "failed": bg.get("failed"),
                                           "memory": sampler.now()})
                    if state in ("done", "failed") or (state is None and now - start - ready_s > 60):
                        break
                sent = time.monotonic()
                answers.append(ask(client, server.url, payloads[i % len(payloads)], start))
                i += 1
                time.sleep(max(0.0, sent + 1 / args.rate - time.monotonic()))
            final = client.get(server.url + "/v1/models").json()["data"][0]["backend"]
            hwm_kib = proc_kib(pid, "VmHWM")
        except Exception as e:  # recorded, not hidden: the timeline up to here is still written
            error, final = f"{type(e).__name__}: {e}", None
        finally:
            sampler.stop()
            hwm_kib = hwm_kib or proc_kib(pid, "VmHWM")
            code = server.stop()
            log_tail = Path(tmp, "service.log").read_text()[-4000:]
            cgroup = None
            if group is not None:
                cgroup = {**group.stats(), "peak_anon_mib_sampled": sampler.peak["anon_bytes"] / 2**20}
                group.remove()
    ok = [a for a in answers if a["status"] == 200]
    requests = requests_summary(answers)
    result = {
        "command": "python -m benchmarks.backend_timeline " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": cpu_features(), "cores": len(os.sched_getaffinity(0)), "artifact": args.artifact,
        "cache": ("the shared IBEDL_CACHE_DIR, its IRs and measurement built ahead" if args.warm_cache else
                  "fresh IBEDL_CACHE_DIR: models/ linked to the shared cache's converted base model, no backends/"),
        "max_seconds": args.max_seconds, "rate_per_s": args.rate,
        "seconds_to_ready": ready_s, "ready_within_60_s": ready_s is not None and ready_s <= 60,
        "background_final": final, "background_timeline": background,
        "background_done_s": next((b["t_s"] for b in background if b["state"] == "done"), None),
        "switches": switches_seen(ok),
        "requests": requests,
        "memory": {"service_peak_rss_mib_vmhwm": hwm_kib / 1024,
                   "service_peak_rss_mib_sampled": sampler.peak["service_rss_kib"] / 1024,
                   "service_and_children_peak_rss_mib_sampled": sampler.peak["with_children_kib"] / 1024,
                   "children_at_that_peak": sampler.peak["children_at_peak"], "bound_mib": 2048,
                   "service_within_bound": hwm_kib / 1024 <= 2048, "cgroup": cgroup},
        "error": error, "service_exit_code": code, "service_log_tail": log_tail,
    }
    write_result(args.output, result)
    print({k: result[k] for k in ("seconds_to_ready", "background_done_s", "switches")}, result["requests"]["failed"],
          result["memory"])
    return 0 if error is None and not requests["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
