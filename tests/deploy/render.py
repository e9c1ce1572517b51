"""Render the committed deploy/ configs for a loopback run without Docker.

Only what differs between the compose network and one machine changes: process settings (pid, log and temp
paths, one worker), the listen address, the upstream server lines and the scrape targets (and the metrics
token's file). Upstream, header, timeout and retry logic, and every alert expression, stay as committed. Each
substitution must match exactly once, so a config edit that the renderer no longer understands fails
loudly instead of silently testing something else.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST_YML = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD_JSON = DEPLOY / "grafana" / "dashboards" / "ibedl.json"
COMPOSE_YML = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"

API_JOB = "ibedl-api"
COMPOSE_METRICS_TOKEN_FILE = "/run/secrets/ibedl_metrics_token"  # the compose secret Prometheus scrapes with
# The compose config's upstream line: `server api:8000 <params>;`
UPSTREAM_SERVER = re.compile(r"^(?P<indent>[ \t]*)server api:8000(?P<params>[^;]*);[ \t]*$", re.MULTILINE)


def require_binary(name: str) -> str:
    """The path of a tool the deploy tests need, or a failure (not a skip) saying how to install it."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        packages = {"nginx": "nginx", "prometheus": "prometheus", "promtool": "prometheus",
                    "kubectl": "kubernetes-client"}
        raise AssertionError(
            f"`{name}` is not installed, and the deploy tests need it: "
            f"apt-get install -y {packages.get(name, name)} (make test installs it as root)"
        )
    return path


def as_on_compose(cmd: list[str], workdir: Path, hosts: dict[str, str] | None = None,
                  secrets: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (to check a committed config file as it is) where the compose network's names resolve
    (``hosts``: name -> address, /etc/hosts) and compose's secrets exist (``secrets``: name -> content, under
    /run/secrets): in a private mount namespace (unshare(1), root, as CI runs), so the machine sees no change."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        raise AssertionError("checking a config as shipped needs unshare(1) (util-linux) and root, as in CI")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in (hosts or {}).items()))
    (workdir / "secrets").mkdir(exist_ok=True)
    for name, content in (secrets or {}).items():
        (workdir / "secrets" / name).write_text(content)
    script = ('mount --bind "$1/hosts" /etc/hosts && mount -t tmpfs tmpfs /run && mkdir /run/secrets '
              '&& mount --bind "$1/secrets" /run/secrets '
              '&& shift && exec "$@"')
    return subprocess.run([unshare, "--mount", "sh", "-c", script, "sh", str(workdir), *cmd], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)


def _sub_once(pattern: str | re.Pattern, repl, text: str, what: str) -> str:
    new, n = re.subn(pattern, repl, text, flags=re.MULTILINE) if isinstance(pattern, str) else pattern.subn(repl, text)
    if n != 1:
        raise AssertionError(f"rendering deploy/nginx/nginx.conf: expected exactly one {what}, found {n}")
    return new


def render_nginx(workdir: Path, listen_port: int, upstreams: list[str], read_timeout_s: int | None = None) -> Path:
    """deploy/nginx/nginx.conf for a gateway on 127.0.0.1:listen_port in front of `upstreams` (host:port);
    `read_timeout_s` shortens proxy_read_timeout (for a test of what a timeout does)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / "temp" / sub).mkdir(parents=True, exist_ok=True)
    text = NGINX_CONF.read_text()
    if os.geteuid() == 0:  # workers run as root too, so they can use the temp dirs under the test's tmp dir
        text = _sub_once(r"^worker_processes\s+\S+;[ \t]*$", "user root root;\nworker_processes auto;", text,
                         "`worker_processes` line")
    text = _sub_once(r"^worker_processes\s+\S+;[ \t]*$", "worker_processes 1;", text, "`worker_processes` line")
    text = _sub_once(r"^pid\s+\S+;[ \t]*$", f"pid {workdir / 'nginx.pid'};", text, "`pid` line")
    text = _sub_once(r"^error_log\s+\S+(\s+\w+)?;[ \t]*$", f"error_log {workdir / 'error.log'} info;", text,
                     "`error_log` line")
    text = _sub_once(r"^([ \t]*)access_log /dev/stdout gateway;[ \t]*$",
                     lambda m: f"{m.group(1)}access_log {workdir / 'access.log'} gateway;", text,
                     "gateway `access_log`")
    text = _sub_once(r"^([ \t]*)listen 8080;[ \t]*$", lambda m: f"{m.group(1)}listen 127.0.0.1:{listen_port};", text,
                     "`listen 8080` line")
    text = _sub_once(
        UPSTREAM_SERVER,
        lambda m: "\n".join(f"{m.group('indent')}server {u}{m.group('params')};" for u in upstreams),
        text, "`server api:8000 resolve ...` upstream line",
    )
    if read_timeout_s is not None:
        text = _sub_once(r"^([ \t]*)proxy_read_timeout \d+s;[ \t]*$",
                         lambda m: f"{m.group(1)}proxy_read_timeout {read_timeout_s}s;", text, "`proxy_read_timeout`")
    temp = "\n".join(f"    {sub}_temp_path {workdir / 'temp' / sub};"
                     for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = _sub_once(r"^http \{[ \t]*$", "http {\n" + temp, text, "`http {` line")
    out = workdir / "nginx.conf"
    out.write_text(text)
    return out


def nginx_command(conf: Path, *args: str) -> list[str]:
    return [require_binary("nginx"), "-p", str(conf.parent), "-e", str(conf.parent / "error.log"), "-c", str(conf),
            *args]


def render_alerts(rule_for: str | None = None) -> dict:
    """deploy/prometheus/alerts.yml, with every `for:` replaced by `rule_for` when given."""
    rules = yaml.safe_load(ALERTS_YML.read_text())
    rendered = copy.deepcopy(rules)
    if rule_for is not None:
        for group in rendered["groups"]:
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = rule_for
    return rendered


def render_prometheus(workdir: Path, listen_port: int, targets: list[str], interval: str = "1s",
                      rule_for: str | None = "2s", metrics_token: str = "metrics-token") -> Path:
    """deploy/prometheus/prometheus.yml scraping `targets` statically every `interval` with `metrics_token` (the
    secret file compose mounts, here a file in `workdir`), with the committed alert rules (their `for:` shortened
    to `rule_for`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"].update(scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval)
    alerts = workdir / "alerts.yml"
    alerts.write_text(yaml.safe_dump(render_alerts(rule_for), sort_keys=False))
    if cfg.get("rule_files") != ["alerts.yml"]:
        raise AssertionError(
            f"deploy/prometheus/prometheus.yml: expected rule_files [alerts.yml], got {cfg.get('rule_files')}")
    cfg["rule_files"] = [str(alerts)]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    if API_JOB not in jobs:
        raise AssertionError(f"deploy/prometheus/prometheus.yml has no scrape job {API_JOB!r}")
    api = jobs[API_JOB]
    api.pop("dns_sd_configs", None)
    api["static_configs"] = [{"targets": list(targets)}]
    if api.get("authorization", {}).get("credentials_file") != COMPOSE_METRICS_TOKEN_FILE:
        raise AssertionError(f"deploy/prometheus/prometheus.yml: the {API_JOB} job should read its bearer token from "
                             f"{COMPOSE_METRICS_TOKEN_FILE}")
    (workdir / "metrics-token").write_text(metrics_token + "\n")
    api["authorization"]["credentials_file"] = str(workdir / "metrics-token")
    if "prometheus" in jobs:
        jobs["prometheus"]["static_configs"] = [{"targets": [f"127.0.0.1:{listen_port}"]}]
    out = workdir / "prometheus.yml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def prometheus_command(config: Path, listen_port: int) -> list[str]:
    return [
        require_binary("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={config.parent / 'data'}",
        f"--web.listen-address=127.0.0.1:{listen_port}",
        "--log.level=warn",
    ]
