"""Secure by default, as the deployment files ship: docker-compose.yml (required secrets, a hardened API container,
nothing published beyond loopback, Grafana without a default password, Prometheus without its lifecycle API,
images at exact versions) and `kubectl kustomize deploy/k8s` (required Secrets, a restricted pod, a NetworkPolicy
that admits only the gateway/ingress and Prometheus, an exact image). kubectl is required (make test installs it)."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.deploy.render import COMPOSE_METRICS_TOKEN_FILE, COMPOSE_YML, DEPLOY, PROMETHEUS_YML, REPO, require_binary

pytestmark = pytest.mark.servers

EXACT_TAG = re.compile(r"^[\w./-]+:v?\d+\.\d+\.\d+(-[\w.]+)?(@sha256:[0-9a-f]{64})?$")  # name:1.2.3[-variant][@digest]
POSTGRES_TAG = re.compile(r"^postgres:\d+\.\d+(-[\w.]+)?(@sha256:[0-9a-f]{64})?$")  # its releases are major.minor
REQUIRED = re.compile(r"^\$\{(\w+):\?[^}]+\}$")  # compose's ${VAR:?message}: no value, no stack
PROJECT_VERSION = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_YML.read_text())


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    r = subprocess.run([require_binary("kubectl"), "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(r.stdout) if d}


def required_variable(value: str) -> str | None:
    m = REQUIRED.match(str(value))
    return m and m.group(1)


# -- docker compose --------------------------------------------------------------------------------------

def test_compose_requires_the_tokens_and_the_grafana_password(compose):
    api = compose["services"]["api"]["environment"]
    assert required_variable(api["IBEDL_API_TOKEN"]) == "IBEDL_API_TOKEN"
    assert required_variable(api["IBEDL_METRICS_TOKEN"]) == "IBEDL_METRICS_TOKEN"
    assert "IBEDL_ALLOW_ANONYMOUS" not in api
    assert api["IBEDL_LABEL_TOKEN"] == "${IBEDL_LABEL_TOKEN:-}"  # optional: without it no label is accepted
    grafana = compose["services"]["grafana"]["environment"]
    assert required_variable(grafana["GF_SECURITY_ADMIN_PASSWORD"]) == "GRAFANA_ADMIN_PASSWORD"  # never admin/admin
    database = compose["services"]["feedback-db"]["environment"]
    assert required_variable(database["POSTGRES_PASSWORD"]) == "IBEDL_FEEDBACK_DB_PASSWORD"  # no default password


def test_prometheus_scrapes_with_the_metrics_token_and_has_no_lifecycle_api(compose):
    prometheus = compose["services"]["prometheus"]
    assert not [flag for flag in prometheus["command"] if "enable-lifecycle" in flag]
    (secret,) = prometheus["secrets"]
    assert compose["secrets"][secret] == {"environment": "IBEDL_METRICS_TOKEN"}  # the replicas' variable
    (job,) = [j for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"] if j["job_name"] == "ibedl-api"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": COMPOSE_METRICS_TOKEN_FILE}
    assert f"/run/secrets/{secret}" == COMPOSE_METRICS_TOKEN_FILE


def test_the_api_container_is_hardened(compose):
    api = compose["services"]["api"]
    assert api["read_only"] is True
    assert [t.split(":")[0] for t in api["tmpfs"]] == ["/tmp"]  # torch's scratch files, nothing else writable
    assert api["cap_drop"] == ["ALL"] and "cap_add" not in api
    assert "no-new-privileges:true" in api["security_opt"]
    assert isinstance(api["pids_limit"], int) and 0 < api["pids_limit"] <= 1024
    assert "ports" not in api and "privileged" not in api  # reached through the gateway only


def test_no_service_gains_privileges_and_ports_bind_loopback_by_default(compose):
    for name, service in compose["services"].items():
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        for port in service.get("ports", []):
            assert re.match(r"^\$\{\w+_BIND:-127\.0\.0\.1\}:", str(port)), (name, port)


def test_compose_images_are_exact_versions(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        if name == "api":  # built here: the project's version unless IBEDL_IMAGE_TAG says otherwise
            assert image == f"ibedl-service:${{IBEDL_IMAGE_TAG:-{PROJECT_VERSION}}}"
        elif image.startswith("postgres:"):
            assert POSTGRES_TAG.match(image), f"{name}: pin {image} to an exact version"
        else:
            assert EXACT_TAG.match(image), f"{name}: pin {image} to an exact version"


# -- Kubernetes ------------------------------------------------------------------------------------------

def pod(k8s) -> dict:
    return k8s["Deployment"]["spec"]["template"]


def test_k8s_secrets_are_required(k8s):
    (container,) = pod(k8s)["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert set(refs) == {"IBEDL_API_TOKEN", "IBEDL_METRICS_TOKEN", "IBEDL_LABEL_TOKEN", "IBEDL_FEEDBACK_KEY",
                         "IBEDL_FEEDBACK_DSN"}
    # the tokens are required; the labelling credential is not (without it no label is accepted: still closed), nor
    # is labelled feedback (without its Secret it is off)
    assert sorted(name for name, ref in refs.items() if ref.get("optional") is True) == [
        "IBEDL_FEEDBACK_DSN", "IBEDL_FEEDBACK_KEY", "IBEDL_LABEL_TOKEN"]
    assert "IBEDL_ALLOW_ANONYMOUS" not in {e["name"] for e in container["env"]}


def test_k8s_pod_security_context(k8s):
    spec = pod(k8s)["spec"]
    (container,) = spec["containers"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    sc = container["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}


def test_k8s_image_is_an_exact_version(k8s):
    (container,) = pod(k8s)["spec"]["containers"]
    assert EXACT_TAG.match(container["image"]) and container["image"] == f"ibedl-service:{PROJECT_VERSION}"


def test_network_policy_admits_only_the_gateway_and_prometheus(k8s):
    policy = k8s["NetworkPolicy"]["spec"]
    labels = pod(k8s)["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()  # it selects the replicas
    assert policy["policyTypes"] == ["Ingress"]
    (container,) = pod(k8s)["spec"]["containers"]
    ports = {p["name"] for p in container["ports"]}
    sources = []
    for rule in policy["ingress"]:
        assert rule["from"], "a rule without `from` admits every source"
        assert ports == {"http", "grpc"}
        # clients (the gateway, an ingress) reach both doors; Prometheus scrapes /metrics over HTTP alone
        expected = ["http"] if "namespaceSelector" in rule["from"][0] and "podSelector" in rule["from"][0] else [
            "http", "grpc"]
        assert [p["port"] for p in rule["ports"]] == expected, rule
        sources += rule["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}} in sources
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}} in sources
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}} in sources
    assert all(s.get("podSelector") != {} and s.get("namespaceSelector") != {} for s in sources)  # no "everyone"
