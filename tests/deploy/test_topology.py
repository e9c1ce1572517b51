"""The docker-compose topology, run for real on loopback without Docker.

Two `python -m ibedl.serve` replicas on the real base model, the nginx gateway from deploy/nginx/nginx.conf in
front of them, and Prometheus from deploy/prometheus/ (the committed alert rules, `for:` shortened) scraping
both. The tests show that the gateway spreads requests over both replicas and keeps request ids, that
Prometheus scrapes both replicas and evaluates the dashboard's queries, that an in-distribution stream
(SciQ validation questions with their support passage) leaves the drift alert quiet while a shifted stream
(RACE questions without their article) makes it fire, that a label sent back (POST /v1/feedback, with the
labelling credential) to the replica that did not answer counts once (the replicas share one feedback store) and
bad labels (the API token's, another label for the same receipt) change nothing, and that a replica stopped with
SIGTERM drains before it exits, is routed around by the gateway and raises IbedlReplicaDown.

The replicas require tokens, as deployed: the clients send the API token through the gateway, labels go with the
labelling credential, Prometheus scrapes with the metrics token. Which replica answered a request comes from the
gateway's access log (clients never see replica addresses).

The adapter is $IBEDL_TOPOLOGY_ARTIFACT (default artifacts/default). nginx and prometheus come from Debian
(`apt-get install nginx prometheus`, make test installs them); without them these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from benchmarks.service_process import free_port
from tests.deploy.render import (
    API_JOB,
    DASHBOARD_JSON,
    REPO,
    nginx_command,
    prometheus_command,
    render_alerts,
    render_nginx,
    render_prometheus,
    require_binary,
)

pytestmark = pytest.mark.servers

# Read at import (collection), before tests/conftest.py points IBEDL_CACHE_DIR at a per-session temp dir:
# the replicas use the shared cache, where the base model is converted once per machine.
SHARED_CACHE = os.environ.get("IBEDL_CACHE_DIR") or str(Path.home() / ".cache" / "ibedl")
ARTIFACT = Path(os.environ.get("IBEDL_TOPOLOGY_ARTIFACT", "artifacts/default"))

DRIFT_WINDOW = 40  # questions per replica in the drift window
DRIFT_BOOTSTRAP = 200
RULE_FOR = "2s"  # every alert's `for:` in the test; expressions stay as committed
DRIFT_ALERT = "IbedlUncertaintyDrift"
DOWN_ALERT = "IbedlReplicaDown"
CLIENTS = 4  # concurrent clients sending questions through the gateway (2 in flight per replica)
LOAD_TIMEOUT_S = 240  # first load on a fresh machine converts the base model (~20 s on an idle CPU)
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
API_TOKEN, METRICS_TOKEN, LABEL_TOKEN = "topology-api-token", "topology-metrics-token", "topology-label-token"
METRICS_AUTH = {"Authorization": f"Bearer {METRICS_TOKEN}"}
LABEL_AUTH = {"Authorization": f"Bearer {LABEL_TOKEN}"}
FEEDBACK_KEY = "topology-feedback-key"


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"<{path}: {e}>"


@dataclass
class Proc:
    """A child process in its own session, with its output in a log file."""

    name: str
    cmd: list[str]
    log: Path
    env: dict | None = None
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited {self.popen.returncode if self.popen else None}"
        return f"--- {self.name} ({state}), {self.log}:\n{tail(self.log)}"


@dataclass
class Topology:
    replicas: list[Proc]
    replica_urls: list[str]
    gateway: Proc
    gateway_url: str
    prometheus: Proc
    prometheus_url: str
    workdir: Path
    http: httpx.Client
    procs: list[Proc] = field(default_factory=list)

    def logs(self) -> str:
        nginx_errors = tail(self.workdir / "nginx" / "error.log")
        return "\n".join(p.describe() for p in self.procs) + f"\n--- nginx error.log:\n{nginx_errors}"

    def addr(self, i: int) -> str:
        return self.replica_urls[i].removeprefix("http://")

    def metrics(self, i: int) -> str:
        r = self.http.get(self.replica_urls[i] + "/metrics", headers=METRICS_AUTH)
        assert r.status_code == 200, r.text
        return r.text

    def upstream_of(self, response: httpx.Response, timeout: float = 5.0) -> str:
        """The replica that answered ``response`` (its address), from the gateway's access log: the last one
        tried, after any retry (", ") or internal redirect (" : ")."""
        request_id = response.headers["x-request-id"]
        log = self.workdir / "nginx" / "access.log"
        deadline = time.monotonic() + timeout
        while True:  # nginx writes the line once the response is sent: maybe a moment after the client read it
            for line in reversed(log.read_text().splitlines()):
                entry = json.loads(line)
                if entry["request_id"] == request_id:
                    return entry["upstream"].replace(" : ", ", ").split(", ")[-1]
            assert time.monotonic() < deadline, f"no access log line for request {request_id}"
            time.sleep(0.05)

    # -- Prometheus HTTP API -------------------------------------------------------------------------
    def prom(self, path: str, **params) -> dict:
        r = self.http.get(self.prometheus_url + path, params=params)
        assert r.status_code == 200, f"Prometheus {path} {params}: {r.status_code} {r.text}"
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.prom("/api/v1/query", query=expr)["result"]

    def alerts(self, name: str, state: str | None = None) -> list[dict]:
        return [a for a in self.prom("/api/v1/alerts")["alerts"]
                if a["labels"].get("alertname") == name and (state is None or a["state"] == state)]

    def evaluated_past_for(self, alert: str, since: float) -> bool:
        """Whether Prometheus has evaluated ``alert`` for longer than its ``for:`` (and one more interval) after
        ``since``, in Prometheus' time: an expression true from ``since`` on would have made it pending, then firing."""
        for group in self.prom("/api/v1/rules")["groups"]:
            for rule in group["rules"]:
                if rule["name"] == alert:
                    last = datetime.fromisoformat(rule["lastEvaluation"]).timestamp()  # year 1 before the first
                    return last >= since + rule["duration"] + group["interval"]
        raise AssertionError(f"Prometheus has no rule {alert}")

    def wait_for(self, what: str, predicate, timeout: float, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}\n{self.logs()}")


def wait_ready(http: httpx.Client, proc: Proc, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited while loading\n{proc.describe()}")
        try:
            r = http.get(url + "/health/ready", timeout=2.0)
            if r.status_code == 200:
                return
            last = r.text
            if r.json().get("status") == "failed":
                raise AssertionError(f"{proc.name} failed to load the adapter: {r.text}\n{proc.describe()}")
        except httpx.TransportError as e:
            last = repr(e)
        time.sleep(0.25)
    raise AssertionError(f"{proc.name} not ready within {timeout} s (last: {last})\n{proc.describe()}")


def wait_http(http: httpx.Client, proc: Proc, url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited at start\n{proc.describe()}")
        try:
            if http.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{proc.name} did not answer {url} within {timeout} s\n{proc.describe()}")


@pytest.fixture(scope="module")
def topology(tmp_path_factory, default_backends_ready):
    require_binary("nginx"), require_binary("prometheus")
    artifact = artifact_dir()
    if not (artifact / "manifest.json").is_file():
        raise AssertionError(
            f"no adapter at {artifact} (IBEDL_TOPOLOGY_ARTIFACT): the topology test serves a real adapter; "
            "train one (make train-default) or point IBEDL_TOPOLOGY_ARTIFACT at an artifact directory"
        )
    work = tmp_path_factory.mktemp("topology")
    ports = [free_port() for _ in range(4)]
    replica_urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    gateway_url, prometheus_url = f"http://127.0.0.1:{ports[2]}", f"http://127.0.0.1:{ports[3]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEDL_")}
    env.update(
        IBEDL_CACHE_DIR=SHARED_CACHE,
        IBEDL_DEVICE="cpu",
        IBEDL_THREADS="1",  # two replicas on a 2-core machine
        # a named backend, built before ready (its IR is cached after the first run): auto would measure the others
        # in the background on the replicas' two cores, which this test of the gateway, drains and alerts is not about
        IBEDL_BACKEND="openvino-fp32",
        IBEDL_DRIFT_WINDOW=str(DRIFT_WINDOW),
        IBEDL_DRIFT_BOOTSTRAP=str(DRIFT_BOOTSTRAP),
        # A request that arrived before SIGTERM but was not queued yet (its questions are checked on a worker
        # thread first) is queued only if its estimated completion, times IBEDL_ADMISSION_MARGIN, fits in the
        # grace period: the SIGTERM test's batch of 8 questions with passages takes seconds on 2 busy cores.
        IBEDL_SHUTDOWN_GRACE_S="30",
        IBEDL_FEEDBACK_KEY=FEEDBACK_KEY,  # both replicas sign and check receipts with one key ...
        IBEDL_FEEDBACK_DB=str(work / "feedback.sqlite"),  # ... and share one feedback store
        IBEDL_LOG_LEVEL="info",
        IBEDL_API_TOKEN=API_TOKEN,
        IBEDL_METRICS_TOKEN=METRICS_TOKEN,
        IBEDL_LABEL_TOKEN=LABEL_TOKEN,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    replicas = [
        Proc(f"replica-{i + 1}", [sys.executable, "-m", "ibedl.serve", "--host", "127.0.0.1", "--port", str(port),
                                  "--grpc-port", "0", "--artifact", str(artifact)], work / f"replica-{i + 1}.log",
             env)
        for i, port in enumerate(ports[:2])
    ]
    nginx_conf = render_nginx(work / "nginx", ports[2], [u.removeprefix("http://") for u in replica_urls])
    gateway = Proc("nginx", nginx_command(nginx_conf, "-g", "daemon off;"), work / "nginx.log")
    prom_conf = render_prometheus(work / "prometheus", ports[3], [u.removeprefix("http://") for u in replica_urls],
                                  rule_for=RULE_FOR, metrics_token=METRICS_TOKEN)
    prometheus = Proc("prometheus", prometheus_command(prom_conf, ports[3]), work / "prometheus.log")
    # the API token on every request (Prometheus' own API ignores it); /metrics calls send the metrics token
    http = httpx.Client(timeout=HTTP_TIMEOUT, trust_env=False, headers={"Authorization": f"Bearer {API_TOKEN}"})
    topo = Topology(replicas, replica_urls, gateway, gateway_url, prometheus, prometheus_url, work, http)
    started = time.monotonic()
    try:
        # The first replica converts the base model into the shared cache if this machine has not yet;
        # the second starts once it is there, so the two never convert concurrently.
        topo.procs.append(replicas[0].start())
        topo.procs.append(gateway.start())
        topo.procs.append(prometheus.start())
        wait_http(http, gateway, gateway_url + "/gateway/health")
        wait_http(http, prometheus, prometheus_url + "/-/ready")
        wait_ready(http, replicas[0], replica_urls[0], LOAD_TIMEOUT_S)
        topo.procs.append(replicas[1].start())
        wait_ready(http, replicas[1], replica_urls[1], LOAD_TIMEOUT_S)
        print(f"topology up in {time.monotonic() - started:.1f} s: replicas {replica_urls}, gateway {gateway_url}, "
              f"prometheus {prometheus_url}")
        yield topo
    finally:
        for proc in reversed(topo.procs):
            proc.stop()
        http.close()


# -- questions ------------------------------------------------------------------------------------------

def as_request(q, with_context: bool = True) -> dict:
    item = {"question": q.question, "options": list(q.options), "id": q.id}
    if with_context and q.context:
        item["context"] = q.context
    return item


def artifact_dir() -> Path:
    return ARTIFACT if ARTIFACT.is_absolute() else REPO / ARTIFACT


@pytest.fixture(scope="module")
def sciq_validation():
    """The SciQ validation questions the adapter's drift reference was computed on (as the manifest records
    them: ibedl.training.finetune loads validation parts with seed 0), or 500 of them for an adapter trained on
    other validation data."""
    from ibedl.training.data import load_dataset

    manifest = json.loads((artifact_dir() / "manifest.json").read_text())
    parts = [p for p in manifest.get("training", {}).get("data", {}).get("validation") or []
             if p.get("dataset") == "sciq"] or [{"dataset": "sciq", "limit": 500}]
    questions = []
    for part in parts:
        questions += load_dataset("sciq", part.get("split") or "validation", limit=part.get("limit"), seed=0)
    return questions


def in_distribution(sciq_validation) -> list[dict]:
    """SciQ validation questions with their support passage: what the adapter was trained and calibrated on."""
    return [as_request(q) for q in sciq_validation]


@pytest.fixture(scope="module")
def shifted():
    """Another domain without its context: RACE reading-comprehension questions without their article.

    The adapter learned to answer science questions by reading the passage that comes with them; exam
    questions about an article it cannot see move the uncertainty mass u well away from the validation
    reference (measured numbers: deploy/README.md, "Drift").
    """
    from ibedl.training.data import load_dataset

    return [as_request(q, with_context=False) for q in load_dataset("race", "validation", limit=400, seed=1)]


def short(items: list[dict]) -> list[dict]:
    """Questions whose passage surely fits the adapter's prompt limit (for tests that expect 200 to each)."""
    return [item for item in items if len(item.get("context", "")) <= 600]


def stream(topo: Topology, items: list[dict], until, max_items: int, deadline_s: float) -> Counter:
    """POST `items` one by one through the gateway from CLIENTS threads, in rounds, until `until(counts)`.

    Returns the count of answered questions per replica address (from the gateway's access log).
    """
    counts: Counter = Counter()
    deadline = time.monotonic() + deadline_s
    sent = 0

    def post(item):
        r = topo.http.post(topo.gateway_url + "/predict", json=item)
        return item, r

    with ThreadPoolExecutor(CLIENTS) as pool:
        while not until(counts):
            assert sent < max_items, f"sent {sent} questions without reaching the goal; per replica: {dict(counts)}"
            assert time.monotonic() < deadline, \
                f"stream ran past {deadline_s} s; per replica: {dict(counts)}\n{topo.logs()}"
            batch = [items[(sent + k) % len(items)] for k in range(2 * CLIENTS)]
            sent += len(batch)
            for item, r in pool.map(post, batch):
                if r.status_code == 413:  # a passage over the adapter's token limit: skipped, as a client would
                    continue
                assert r.status_code == 200, f"{item['id']}: {r.status_code} {r.text}\n{topo.logs()}"
                counts[topo.upstream_of(r)] += 1
    return counts


def drift(topo: Topology, i: int) -> dict:
    r = topo.http.get(topo.replica_urls[i] + "/v1/drift")
    assert r.status_code == 200, r.text
    return r.json()


def metric_value(text: str, name: str, **labels) -> float:
    """One sample of the Prometheus text exposition `text` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric, _, rest = key.partition("{")
        if metric != name:
            continue
        got = ",".join(sorted(p for p in rest.rstrip("}").split(",") if p))
        if got == want:
            return float(value)
    return 0.0


# -- tests --------------------------------------------------------------------------------------------

def test_gateway_spreads_requests_and_keeps_request_ids(topology, sciq_validation):
    topo = topology
    before = [topo.metrics(i) for i in range(2)]
    questions = short(in_distribution(sciq_validation))[:8]
    upstreams = []
    for k, item in enumerate(questions):
        r = topo.http.post(topo.gateway_url + "/predict", json=item, headers={"X-Request-ID": f"topology-{k}"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == f"topology-{k}"
        assert r.json()["id"] == item["id"]
        assert "x-upstream" not in r.headers
        upstreams.append(topo.upstream_of(r))
    # (a) both replicas answered, as the gateway's log says ...
    assert set(upstreams) == {topo.addr(0), topo.addr(1)}, upstreams
    # ... and as their own counters say
    after = [topo.metrics(i) for i in range(2)]
    for i in range(2):
        served = (metric_value(after[i], "ibedl_requests_total", route="/predict", method="POST", status="200")
                  - metric_value(before[i], "ibedl_requests_total", route="/predict", method="POST", status="200"))
        assert served == upstreams.count(topo.addr(i)), (i, served, upstreams)

    # Without an X-Request-ID the gateway makes one (nginx's 32-hex $request_id) and the replica echoes it.
    r = topo.http.post(topo.gateway_url + "/predict", json=questions[0])
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and int(rid, 16) >= 0 and r.json()["id"] == questions[0]["id"]
    r = topo.http.post(topo.gateway_url + "/predict", json={k: v for k, v in questions[0].items() if k != "id"})
    assert r.json()["id"] == r.headers["x-request-id"]  # the service names the answer after the request id
    # A header that is no sane token is replaced, not forwarded.
    r = topo.http.get(topo.gateway_url + "/health/ready", headers={"X-Request-ID": "bad id\twith spaces"})
    assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32

    # The replicas require their tokens, behind the gateway too: the API token for the API, the metrics token
    # (not the API token) for /metrics.
    anonymous = httpx.Client(timeout=HTTP_TIMEOUT, trust_env=False)
    assert anonymous.post(topo.gateway_url + "/predict", json=questions[0]).status_code == 401
    assert anonymous.get(topo.replica_urls[0] + "/metrics").status_code == 401
    assert topo.http.get(topo.replica_urls[0] + "/metrics").status_code == 401
    assert anonymous.get(topo.gateway_url + "/health/ready").status_code == 200
    anonymous.close()

    # Health passes through; the gateway has its own liveness; metrics are per replica only.
    assert topo.http.get(topo.gateway_url + "/health/live").status_code == 200
    assert topo.http.get(topo.gateway_url + "/gateway/health").status_code == 200
    assert topo.http.get(topo.gateway_url + "/metrics").status_code == 404
    # Bodies over the gateway's limit stop at the gateway, in the service's error shape.
    r = topo.http.post(topo.gateway_url + "/predict", content=b"x" * (2 << 20),
                       headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "too_large"
    # Service errors pass through unchanged.
    r = topo.http.post(topo.gateway_url + "/predict", json={"question": "Which?", "options": ["only one"]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "options"


def test_prometheus_scrapes_both_replicas(topology):
    topo = topology
    addrs = {topo.addr(0), topo.addr(1)}

    def both_up():
        targets = topo.prom("/api/v1/targets")["activeTargets"]
        api = {t["labels"]["instance"]: t["health"] for t in targets if t["labels"]["job"] == API_JOB}
        return api if api == {a: "up" for a in addrs} else None

    topo.wait_for("both replicas up in /api/v1/targets", both_up, timeout=20)
    # (b) the ibedl_ metrics of both replicas can be queried
    up = {r["metric"]["instance"]: r["value"][1] for r in topo.query(f'up{{job="{API_JOB}"}}')}
    assert up == {a: "1" for a in addrs}
    # a replica's target may have been scraped up while it was still loading (ibedl_ready 0): the next scrape
    # after its readiness says 1
    def both_ready():
        ready = {r["metric"]["instance"]: r["value"][1] for r in topo.query("ibedl_ready")}
        return ready if ready == {a: "1" for a in addrs} else None

    topo.wait_for("ibedl_ready 1 from both replicas", both_ready, timeout=20)
    info = topo.query("ibedl_model_info")
    assert {r["metric"]["instance"] for r in info} == addrs
    manifest = json.loads((artifact_dir() / "manifest.json").read_text())
    assert {r["metric"]["adapter"] for r in info} == {manifest["name"]}
    served = f'sum(ibedl_requests_total{{job="{API_JOB}", route="/predict", status="200"}}) > 0'
    topo.wait_for("requests of test (a) in Prometheus", lambda: topo.query(served), timeout=15)
    threshold = topo.query("ibedl_drift_ks_threshold")
    assert len(threshold) == 2 and all(0 < float(r["value"][1]) < 1 for r in threshold), threshold

    # Every query of the Grafana dashboard evaluates on this Prometheus (as Grafana would send it).
    dashboard = json.loads(DASHBOARD_JSON.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    for expr in exprs:
        q = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        topo.query(q)  # asserts status success
    # ... and the main ones have data once a few scrapes of the traffic of test (a) are in
    for expr in ['sum(rate(ibedl_requests_total{job="ibedl-api", instance=~".*"}[1m]))',
                 'sum(increase(ibedl_uncertainty_mass_bucket{job="ibedl-api", instance=~".*", le="+Inf"}[1m]))',
                 'max(ibedl_drift_window{job="ibedl-api", instance=~".*"}) > 0']:
        topo.wait_for(f"data for {expr}", lambda expr=expr: topo.query(expr), timeout=15)


def test_drift_alert_quiet_in_distribution_and_firing_on_shift(topology, sciq_validation, shifted):
    topo = topology
    addrs = [topo.addr(0), topo.addr(1)]
    # The rules Prometheus evaluates are the committed ones (only `for:` is shortened).
    def squeeze(expr: str) -> str:
        return "".join(expr.split())

    committed = {r["alert"]: squeeze(r["expr"]) for g in render_alerts()["groups"] for r in g["rules"]}
    loaded = {r["name"]: squeeze(r["query"]) for g in topo.prom("/api/v1/rules")["groups"] for r in g["rules"]}
    assert loaded == committed

    # 1. In-distribution: fill each replica's window with SciQ questions that come with their passage.
    started = time.monotonic()
    counts = stream(topo, in_distribution(sciq_validation), until=lambda c: all(c[a] >= DRIFT_WINDOW for a in addrs),
                    max_items=6 * DRIFT_WINDOW, deadline_s=120)
    calm = [drift(topo, i) for i in range(2)]
    print(f"in-distribution: {sum(counts.values())} questions in {time.monotonic() - started:.1f} s, "
          f"per replica {dict(counts)}; drift: " + json.dumps(calm))
    for d in calm:
        assert d["window"] == DRIFT_WINDOW and d["statistic"] == "uncertainty_mass", d
        assert not d["alarm"] and d["ks"] <= d["ks_threshold"], f"in-distribution stream raised the drift alarm: {d}"
    # Prometheus has scraped the full windows, evaluated the rule for longer than its `for:`, and never saw it pending.
    def full_windows():
        found = topo.query(f"ibedl_drift_window == {DRIFT_WINDOW}")
        return found if len(found) == 2 else None

    full = topo.wait_for("full drift windows in Prometheus", full_windows, timeout=15)
    seen = max(float(r["value"][0]) for r in full)  # the query's time: both windows were full in Prometheus by then
    topo.wait_for(f"{DRIFT_ALERT} evaluated past its `for:` on the full windows",
                  lambda: topo.evaluated_past_for(DRIFT_ALERT, seen), timeout=30)
    assert topo.query("max(ibedl_drift_alarm)")[0]["value"][1] == "0"
    assert topo.alerts(DRIFT_ALERT) == [], topo.alerts(DRIFT_ALERT)
    span = int(time.monotonic() - started) + 5
    assert topo.query(f'count_over_time(ALERTS{{alertname="{DRIFT_ALERT}"}}[{span}s])') == []

    # 2. Shifted: questions of another domain without their passage, until the alert fires.
    started = time.monotonic()

    def firing(_counts=None):
        return topo.alerts(DRIFT_ALERT, "firing")

    counts = stream(topo, shifted, until=firing, max_items=8 * DRIFT_WINDOW, deadline_s=150)
    drifted = [drift(topo, i) for i in range(2)]
    print(f"shifted: {sum(counts.values())} questions in {time.monotonic() - started:.1f} s, "
          f"per replica {dict(counts)}; drift: " + json.dumps(drifted))
    alerts = topo.alerts(DRIFT_ALERT, "firing")
    assert alerts and {a["labels"]["instance"] for a in alerts} <= set(addrs)
    for a in alerts:
        assert a["labels"]["severity"] == "warning" and a["annotations"]["summary"] and a["annotations"]["description"]
        d = drifted[addrs.index(a["labels"]["instance"])]
        assert d["ks"] > d["ks_threshold"], d  # the replica Prometheus alerts on is the one whose window drifted
        assert float(a["value"]) > d["ks_threshold"]  # the alert's value is that KS statistic


def guarantee_counts(topo: Topology, i: int) -> dict:
    r = topo.http.get(topo.replica_urls[i] + "/v1/guarantees")
    assert r.status_code == 200, r.text
    return {(g["guarantee"], g["stated"]): (g["labels"], g["hits"]) for g in r.json()["guarantees"]}


def test_feedback_reaches_any_replica_and_counts_once(topology, sciq_validation):
    """A label sent to the replica that did not answer is counted; sent again, through the gateway or to either
    replica, it is a duplicate; bad labels get a 4xx through the gateway and change nothing; both replicas and
    Prometheus report the same realised guarantees."""
    topo = topology
    item = short(in_distribution(sciq_validation))[0]
    r = topo.http.post(topo.replica_urls[0] + "/predict", json=item)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["receipt"], answer
    before = guarantee_counts(topo, 0)
    share = before.get(("answered_share", None), (0, 0))[0]

    # the replica that did not answer counts it (the API token may not label: 403, nothing counted)
    label = {"receipt": answer["receipt"], "label": answer["prediction"]["letter"]}
    r = topo.http.post(topo.gateway_url + "/v1/feedback", json=label)
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden", r.text
    assert guarantee_counts(topo, 0) == before
    r = topo.http.post(topo.replica_urls[1] + "/v1/feedback", json=label, headers=LABEL_AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["recorded"] == 1 and r.json()["results"][0]["status"] == "recorded"
    after = [guarantee_counts(topo, i) for i in range(2)]
    assert after[0] == after[1] and after[0][("answered_share", None)][0] == share + 1

    # the same label again, through the gateway (either replica) and to the one that answered: counted once
    for url in (topo.gateway_url, topo.gateway_url, topo.replica_urls[0]):
        r = topo.http.post(url + "/v1/feedback", json=label, headers=LABEL_AUTH)
        assert r.status_code == 200 and r.json()["duplicates"] == 1, r.text

    # bad inputs through the gateway: 4xx in the service's error shape, nothing counted
    letters = list(answer["probabilities"])
    version, payload, mac = answer["receipt"].split(".")
    bad = [
        ({"receipt": f"{version}.{payload[:-2]}AA.{mac}", "label": "A"}, 422, "invalid_receipt"),  # tampered
        ({"receipt": "v1.bm90.aGVsbG8", "label": "A"}, 422, "invalid_receipt"),  # unknown
        ({"receipt": answer["receipt"], "label": chr(ord(letters[-1]) + 1)}, 422, "invalid_request"),  # no such option
        ({"receipt": answer["receipt"], "label": next(x for x in letters if x != label["label"])}, 409,
         "label_conflict"),  # another label for a labelled receipt: the first stands
    ]
    other = topo.http.post(topo.gateway_url + "/predict", json=short(in_distribution(sciq_validation))[1]).json()
    bad.append(({"items": [{"receipt": other["receipt"], "label": "A"},
                           {"receipt": "forged", "label": "A"}]}, 422, "invalid_receipt"))  # a batch: all or none
    for body, status, type_ in bad:
        path = "/v1/feedback/batch" if "items" in body else "/v1/feedback"
        r = topo.http.post(topo.gateway_url + path, json=body, headers=LABEL_AUTH)
        assert r.status_code == status and r.json()["error"]["type"] == type_, (body, r.status_code, r.text)
    assert [guarantee_counts(topo, i) for i in range(2)] == after
    conflicts = sum(metric_value(topo.metrics(i), "ibedl_feedback_conflicts_total", adapter=answer["adapter"]["name"])
                    for i in range(2))
    assert conflicts == 1

    # Prometheus sees the same totals on both replicas (aggregate with max, never sum)
    expr = 'ibedl_guarantee_labels{job="ibedl-api", guarantee="answered_share"}'
    want = str(share + 1)
    topo.wait_for("both replicas' guarantee gauges in Prometheus",
                  lambda: [r for r in topo.query(expr) if r["value"][1] == want] if len(
                      [r for r in topo.query(expr) if r["value"][1] == want]) == 2 else None, timeout=20)


def test_sigterm_drains_and_gateway_routes_around_a_stopped_replica(topology, sciq_validation):
    topo = topology
    survivor, stopped = topo.addr(0), topo.addr(1)
    questions = short(in_distribution(sciq_validation))
    # A batch in flight on the replica that gets SIGTERM ...
    inflight: dict = {}

    def post_batch():
        inflight["response"] = topo.http.post(topo.replica_urls[1] + "/predict/batch", json={"items": questions[:8]})

    worker = threading.Thread(target=post_batch, daemon=True)
    worker.start()
    topo.wait_for("the batch in flight on replica 2",
                  lambda: metric_value(topo.metrics(1),
                                       "ibedl_inflight_requests") >= 1,
                  timeout=10, interval=0.05)
    topo.replicas[1].popen.send_signal(signal.SIGTERM)
    # ... while the gateway keeps answering from the other one,
    for item in questions[8:12]:
        r = topo.http.post(topo.gateway_url + "/predict", json=item)
        assert r.status_code == 200, r.text
        assert topo.upstream_of(r) == survivor
    # ... is answered in full before the replica exits.
    worker.join(60)
    assert not worker.is_alive(), "the in-flight batch got no answer"
    r = inflight["response"]
    assert r.status_code == 200 and len(r.json()["results"]) == 8, r.text
    try:
        code = topo.replicas[1].popen.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"replica 2 did not exit within 30 s of SIGTERM\n{topo.replicas[1].describe()}") from None
    assert code == 0, f"replica exited {code} on SIGTERM\n{topo.replicas[1].describe()}"
    assert "Application shutdown complete" in tail(topo.replicas[1].log, 20000), topo.replicas[1].describe()

    assert topo.http.get(topo.gateway_url + "/health/ready").status_code == 200
    topo.wait_for(f"{DOWN_ALERT} firing for {stopped}",
                  lambda: [a for a in topo.alerts(DOWN_ALERT, "firing") if a["labels"]["instance"] == stopped],
                  timeout=20)
    assert not [a for a in topo.alerts(DOWN_ALERT) if a["labels"]["instance"] == survivor]
