"""The Kubernetes manifests (deploy/k8s): `kubectl kustomize deploy/k8s` renders; every document validates
offline, the built-in kinds against the Kubernetes OpenAPI schemas of every version `kubernetes-validate`
bundles (strict: unknown fields fail), the ServiceMonitor and PrometheusRule against the Prometheus operator's
CRD types (`cloudcoil-models-prometheus-operator`); and the rendered objects keep what the service needs:
probes on its health routes and port, a grace period longer than its drain, a non-root read-only pod, resources
that match its threads, the alert rules of deploy/prometheus/alerts.yml, selectors that find its pods.

kubectl is required (make test installs Debian's kubernetes-client when it is missing): no skip.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess

import kubernetes_validate
import pydantic
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as monitoring_v1
from kubernetes_validate.utils import all_versions

from ibedl.serve.routes import router
from ibedl.serve.settings import Settings
from tests.deploy.render import ALERTS_YML, API_JOB, DEPLOY, DOCKERFILE, REPO, require_binary
from tests.deploy.test_configs import exposed_metric_names

pytestmark = pytest.mark.servers  # needs kubectl, like the other deploy checks need nginx and promtool

K8S = DEPLOY / "k8s"
KINDS = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule",
         "NetworkPolicy"}
CRD_MODELS = {"ServiceMonitor": monitoring_v1.ServiceMonitor, "PrometheusRule": monitoring_v1.PrometheusRule}
K8S_VERSIONS = sorted(set(all_versions()), key=lambda v: tuple(map(int, v.split("."))))


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    """`kubectl kustomize deploy/k8s`, one document per kind."""
    kubectl = require_binary("kubectl")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, f"kubectl kustomize {K8S} exited {r.returncode}:\n{r.stderr}"
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == sorted(KINDS), kinds
    return {d["kind"]: d for d in docs}


def pod_spec(rendered) -> dict:
    return rendered["Deployment"]["spec"]["template"]["spec"]


def container(rendered) -> dict:
    containers = pod_spec(rendered)["containers"]
    assert len(containers) == 1
    return containers[0]


def env(rendered) -> dict[str, dict]:
    return {e["name"]: e for e in container(rendered).get("env", [])}


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- schemas ---------------------------------------------------------------------------------------------

def test_builtin_kinds_validate_against_every_bundled_kubernetes_version(rendered):
    assert K8S_VERSIONS[0] == "1.25.0" and len(K8S_VERSIONS) >= 13, K8S_VERSIONS
    for version in K8S_VERSIONS:
        for kind, doc in rendered.items():
            if kind not in CRD_MODELS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_validation_rejects_a_misspelt_field_and_a_wrong_type(rendered):
    misspelt = copy.deepcopy(rendered["Deployment"])
    misspelt["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {"httpGet": {"path": "/", "port": 1}}
    wrong_type = copy.deepcopy(rendered["Deployment"])
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45s"
    for doc in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def crd_roundtrip(doc: dict) -> dict:
    """The document as the operator's CRD types read it: types, enums and patterns are checked, and a field the
    CRD does not know is dropped, so the result differs from `doc`."""
    model = CRD_MODELS[doc["kind"]].model_validate(doc)
    return model.model_dump(by_alias=True, exclude_unset=True, mode="json")


def test_servicemonitor_and_prometheusrule_validate_against_the_operator_crds(rendered):
    for kind in CRD_MODELS:
        assert rendered[kind]["apiVersion"] == "monitoring.coreos.com/v1"
        assert crd_roundtrip(rendered[kind]) == rendered[kind], f"{kind}: fields the CRD does not know"


def test_crd_validation_rejects_an_unknown_field_and_a_bad_duration(rendered):
    unknown = copy.deepcopy(rendered["ServiceMonitor"])
    unknown["spec"]["endpoints"][0]["intervall"] = "15s"
    assert crd_roundtrip(unknown) != unknown
    bad = copy.deepcopy(rendered["PrometheusRule"])
    bad["spec"]["groups"][0]["rules"][0]["for"] = "10 minutes"
    with pytest.raises(pydantic.ValidationError):
        crd_roundtrip(bad)


# -- the alert rules -------------------------------------------------------------------------------------

def test_prometheusrule_holds_exactly_the_rules_of_alerts_yml(rendered):
    assert rendered["PrometheusRule"]["spec"] == yaml.safe_load(ALERTS_YML.read_text())


def test_committed_prometheusrule_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("prometheusrule", K8S / "prometheusrule.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (K8S / "prometheusrule.yaml").read_text() == generator.render(ALERTS_YML.read_text()), (
        "deploy/k8s/prometheusrule.yaml is stale: run python deploy/k8s/prometheusrule.py")


def test_prometheus_labels_the_replicas_with_the_job_the_rules_select(rendered):
    # A ServiceMonitor's targets get job = the Service's name unless jobLabel picks a Service label.
    monitor, service = rendered["ServiceMonitor"], rendered["Service"]
    assert "jobLabel" not in monitor["spec"]
    assert service["metadata"]["name"] == API_JOB
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and any(r.path == "/metrics" for r in router.routes)


# -- the pod ---------------------------------------------------------------------------------------------

def served_port(rendered, variable: str = "IBEDL_PORT") -> int:
    """The port the container's `python -m ibedl.serve` listens on (``variable``: IBEDL_PORT for HTTP, IBEDL_GRPC_PORT
    for gRPC): the manifest's, else the image's."""
    if variable in env(rendered):
        return int(env(rendered)[variable]["value"])
    ports = re.findall(rf"\b{variable}=(\d+)", DOCKERFILE.read_text())
    assert len(ports) == 1, ports
    return int(ports[0])


def test_probes_use_the_health_routes_on_the_served_port(rendered):
    c = container(rendered)
    assert "command" not in c and "args" not in c, "the image's entrypoint runs"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": served_port(rendered), "grpc": served_port(rendered, "IBEDL_GRPC_PORT")}
    routes = {r.path for r in router.routes}
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert ports.get(get["port"], get["port"]) == served_port(rendered), probe
        assert get["path"] in routes, (probe, get["path"])
        paths[probe] = get["path"]
    # Liveness must not fail while the model loads or the replica drains: that would restart a healthy process.
    assert paths == {"startupProbe": "/health/ready", "readinessProbe": "/health/ready",
                     "livenessProbe": "/health/live"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "too little time to load the model"


def test_grace_period_outlasts_the_prestop_sleep_and_the_drain(rendered):
    c = container(rendered)
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    pre_stop = float(command[1])
    assert pre_stop >= 5, "the endpoint needs a few seconds to leave every node's Service routing"
    drain = env(rendered).get("IBEDL_SHUTDOWN_GRACE_S", {}).get("value")
    drain = float(drain) if drain is not None else Settings.model_fields["shutdown_grace_s"].default
    assert pod_spec(rendered)["terminationGracePeriodSeconds"] >= pre_stop + drain + 5


def test_pod_runs_as_non_root_on_a_read_only_root_without_capabilities_or_token(rendered):
    pod, c = pod_spec(rendered), container(rendered)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert re.search(rf"^USER {pod['securityContext']['runAsUser']}:", DOCKERFILE.read_text(), re.M), \
        "runAsUser is the image's user"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]], "torch writes under /tmp"


def test_resources_are_set_and_match_the_threads(rendered):
    resources = container(rendered)["resources"]
    assert resources["requests"] == resources["limits"], "Guaranteed QoS"
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert int(env(rendered)["IBEDL_THREADS"]["value"]) == int(resources["requests"]["cpu"])
    memory = re.fullmatch(r"(\d+)(Mi|Gi)", resources["limits"]["memory"])
    assert memory and int(memory[1]) * {"Mi": 1, "Gi": 1024}[memory[2]] >= 1536, "the torch replica needs ~1 GB"


def test_tokens_come_from_required_secrets(rendered):
    for variable, setting, secret in [("IBEDL_API_TOKEN", "api_token", "ibedl-api-token"),
                                      ("IBEDL_METRICS_TOKEN", "metrics_token", "ibedl-metrics-token")]:
        token = env(rendered)[variable]
        assert "value" not in token
        assert token["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "token"}  # not optional: no pod without
        assert setting in Settings.model_fields  # the variable is a setting
    label = env(rendered)["IBEDL_LABEL_TOKEN"]  # optional: without it the service accepts no label
    assert label["valueFrom"]["secretKeyRef"] == {"name": "ibedl-label-token", "key": "token", "optional": True}
    assert "label_token" in Settings.model_fields
    # Prometheus scrapes with the metrics token, from the same Secret
    (endpoint,) = rendered["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "ibedl-metrics-token",
                                                                           "key": "token"}}


def test_image_is_set_by_kustomize_to_the_project_version(rendered):
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    version = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]
    assert image == {"name": "ibedl-service", "newTag": version}
    assert container(rendered)["image"] == f"ibedl-service:{version}"


# -- the objects around the pods -------------------------------------------------------------------------

def test_service_pdb_and_hpa_select_the_deployments_pods(rendered):
    deployment = rendered["Deployment"]
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pods)
    assert matches(rendered["Service"]["spec"]["selector"], pods)
    assert rendered["Service"]["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container(rendered)["ports"]}
    assert matches(rendered["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], pods)
    hpa = rendered["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    # A drain may take one replica; at least one other keeps answering.
    assert rendered["PodDisruptionBudget"]["spec"]["maxUnavailable"] < hpa["minReplicas"]
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]


def test_hpa_queue_depth_recipe_names_a_metric_the_service_exposes():
    text = (K8S / "hpa.yaml").read_text()
    names = set(re.findall(r"\bibedl_\w+", text))
    assert names and names <= exposed_metric_names(), names - exposed_metric_names()


# -- labelled feedback: the store ------------------------------------------------------------------------

def test_feedback_comes_from_one_optional_secret(rendered):
    """Without the Secret ibedl-feedback feedback is off; with it every replica signs with its key and records in
    the PostgreSQL store its DSN names (never a value in the manifest)."""
    for variable, setting, key in [("IBEDL_FEEDBACK_KEY", "feedback_key", "key"),
                                   ("IBEDL_FEEDBACK_DSN", "feedback_dsn", "dsn")]:
        ref = env(rendered)[variable]
        assert "value" not in ref and setting in Settings.model_fields
        assert ref["valueFrom"]["secretKeyRef"] == {"name": "ibedl-feedback", "key": key, "optional": True}
    assert "IBEDL_FEEDBACK_DB" not in env(rendered)  # a SQLite file cannot be shared across nodes
    days = int(env(rendered)["IBEDL_FEEDBACK_RETENTION_DAYS"]["value"])
    assert days * 86400 >= Settings.model_fields["feedback_ttl_s"].default  # outlives the receipts


@pytest.fixture(scope="module")
def with_feedback_db(tmp_path_factory) -> dict[str, dict]:
    """An overlay as deploy/k8s/feedback-db/kustomization.yaml shows it (the base and the component), rendered."""
    import os

    overlay = tmp_path_factory.mktemp("overlay")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S, overlay)], "components": [os.path.relpath(K8S / "feedback-db", overlay)]}))
    r = subprocess.run([require_binary("kubectl"), "kustomize", str(overlay)], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout) if d}


@pytest.mark.parametrize("component", [False, True], ids=["base", "with-feedback-db"])
def test_the_readmes_overlay_renders_and_opens_the_replicas_to_its_namespaces(tmp_path, component):
    """The overlay deploy/README.md tells a user to write, on the base alone and with the feedback-db component the
    README adds: its patches apply (a patch aimed at every NetworkPolicy failed on the database's)."""
    import os

    readme = (DEPLOY / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "kind: Kustomization" in b]
    overlay = yaml.safe_load(block)
    overlay["resources"] = [os.path.relpath(K8S, tmp_path)]
    if component:
        overlay["components"] = [os.path.relpath(K8S / "feedback-db", tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    r = subprocess.run([require_binary("kubectl"), "kustomize", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout) if d}
    ingress = docs[("NetworkPolicy", "ibedl-api")]["spec"]["ingress"]
    assert ingress[0]["from"][1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ingress-nginx"}
    assert ingress[1]["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert ("NetworkPolicy", "ibedl-feedback-db") in docs or not component


def test_the_feedback_db_component_validates_and_serves_the_replicas_only(with_feedback_db):
    docs = with_feedback_db
    db = docs[("StatefulSet", "ibedl-feedback-db")]
    for doc in docs.values():
        if doc["kind"] not in CRD_MODELS:
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    pod = db["spec"]["template"]
    (postgres,) = pod["spec"]["containers"]
    assert re.fullmatch(r"postgres:\d+\.\d+-alpine", postgres["image"])  # pinned
    assert db["spec"]["replicas"] == 1
    (claim,) = db["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/var/lib/postgresql/data"} in postgres["volumeMounts"]
    variables = {e["name"]: e for e in postgres["env"]}
    assert variables["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ibedl-feedback",
                                                                          "key": "db-password"}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert postgres["securityContext"]["readOnlyRootFilesystem"] is True
    # the DSN's host is the Service, which finds the database's pod on its port
    service = docs[("Service", "ibedl-feedback-db")]
    assert "ibedl-feedback-db:5432" in (K8S / "feedback-db" / "kustomization.yaml").read_text()
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    assert service["spec"]["ports"][0]["port"] == 5432
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in postgres["ports"]}
    # only the replicas reach it
    policy = docs[("NetworkPolicy", "ibedl-feedback-db")]["spec"]
    assert matches(policy["podSelector"]["matchLabels"], pod["metadata"]["labels"])
    ((source,),) = [rule["from"] for rule in policy["ingress"]]
    api_pods = docs[("Deployment", "ibedl-api")]["spec"]["template"]["metadata"]["labels"]
    assert matches(source["podSelector"]["matchLabels"], api_pods) and "namespaceSelector" not in source
    assert not matches(policy["podSelector"]["matchLabels"], api_pods)
