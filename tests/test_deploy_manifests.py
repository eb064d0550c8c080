"""Every manifest under deploy/ is validated: Kubernetes' own kinds against
the Kubernetes schemas that ``kubernetes-validate`` bundles (offline,
strict: an unknown field is an error), the KServe and Prometheus-operator
kinds against the CRD schemas shipped in deploy/schemas/ (with
``jsonschema``, made strict the same way). Then the manifests are checked
against each other and against the server: probes, ports, the drain, the
autoscaler's metrics."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tensorserve.settings import Settings
from tests.conftest import ROOT
from tests.test_observability_docs import checker

DEPLOY = ROOT / "deploy"
KUBERNETES_VERSIONS = ["1.29", "1.37"]  # the oldest and newest the checks pin
CRD_SCHEMAS = {  # (apiVersion, kind) -> the file in deploy/schemas/
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "kserve-servingruntime-v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "kserve-inferenceservice-v1beta1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring-podmonitor-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject-v1alpha1.json",
}


def manifest_files() -> list[Path]:
    return sorted(
        p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml" and "schemas" not in p.parts
    )


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(str(p.relative_to(ROOT)), doc) for p in manifest_files() for doc in documents(p)]


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused where the API server prunes
    them (every object with properties, unless it preserves unknown fields),
    as ``kubectl apply --validate=strict`` reports them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in schema
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    shipped = json.loads((DEPLOY / "schemas" / CRD_SCHEMAS[(api_version, kind)]).read_text())
    assert f"{shipped['group']}/{shipped['version']}" == api_version and shipped["kind"] == kind
    schema = strict(shipped["openAPIV3Schema"])
    # apiVersion/kind/metadata are the API server's; the CRD says only "object".
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "spec"})
    return jsonschema.Draft7Validator(schema)


def validate(doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        crd_validator(*key).validate(doc)
    else:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("where, doc", all_documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_is_valid(where: str, doc: dict[str, Any]) -> None:
    validate(doc)


def test_the_manifests_cover_what_a_deployment_needs() -> None:
    kinds = sorted({doc["kind"] for _, doc in all_documents()})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "InferenceService",
        "PodMonitor",
        "ScaledObject",
        "Service",
        "ServingRuntime",
    ]


@pytest.mark.parametrize(
    "where, path, value",
    [
        ("kubernetes/gpu/deployment.yaml", ["spec", "template", "spec", "containers", 0, "imagePullPolcy"], "Always"),
        ("kubernetes/gpu/deployment.yaml", ["spec", "template", "spec", "terminationGracePeriodSeconds"], "30s"),
        ("kserve/servingruntime.yaml", ["spec", "protocolVersion"], "v2"),
        ("kserve/servingruntime.yaml", ["spec", "supportedModelFormats", 0, "autoselect"], True),
        ("kserve/inferenceservice.yaml", ["spec", "predictor", "model", "storageURI"], "s3://x"),
        ("kubernetes/base/podmonitor.yaml", ["spec", "podMetricsEndpoints", 0, "interval"], 15),
        ("kubernetes/base/hpa.yaml", ["spec", "maxReplicas"], "eight"),
        ("kubernetes/prometheus-adapter/rules.yaml", ["data", "config.yaml"], {"rules": []}),
        ("kubernetes/keda/scaledobject.yaml", ["spec", "triggers", 0, "metadata", "threshold"], 32),
        ("kubernetes/keda/scaledobject.yaml", ["spec", "scaleTargetRef", "nmae"], "tensorserve"),
    ],
)
def test_a_mistake_fails_validation(where: str, path: list[Any], value: Any) -> None:
    # The validation bites: a misspelt field or a wrong type is an error.
    (doc,) = documents(DEPLOY / where)
    broken = copy.deepcopy(doc)
    node = broken
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(broken)


# --------------------------------------------------------------- kustomize
def kustomize(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize folder`` renders, for kustomizations that only
    list resources (the test below keeps them so): the resources in order."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(spec) <= {"apiVersion", "kind", "resources"}, "resources only: no patches"
    rendered: list[dict[str, Any]] = []
    for entry in spec["resources"]:
        target = folder / entry
        rendered += kustomize(target) if target.is_dir() else documents(target)
    return rendered


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_each_variant_renders_the_shared_objects_and_its_deployment(variant: str) -> None:
    rendered = kustomize(DEPLOY / "kubernetes" / variant)
    assert sorted(d["kind"] for d in rendered) == [
        "Deployment", "HorizontalPodAutoscaler", "PodMonitor", "Service"
    ]
    kubectl = shutil.which("kubectl")
    if kubectl is not None:  # where kubectl is installed, it agrees
        out = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / "kubernetes" / variant)],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        key = lambda d: (d["kind"], d["metadata"]["name"])
        assert sorted(map(key, yaml.safe_load_all(out))) == sorted(map(key, rendered))


def deployment(variant: str) -> dict[str, Any]:
    (doc,) = documents(DEPLOY / "kubernetes" / variant / "deployment.yaml")
    return doc


def test_the_cpu_deployment_differs_from_the_gpu_one_only_in_image_resources_and_tolerations() -> None:
    gpu, cpu = deployment("gpu"), deployment("cpu")
    for doc in (gpu, cpu):
        pod = doc["spec"]["template"]["spec"]
        pod.pop("tolerations", None)
        pod["containers"][0].pop("image")
        pod["containers"][0].pop("resources")
    assert gpu == cpu


def test_the_gpu_deployment_asks_for_a_gpu_and_the_cpu_one_sets_a_cpu_quota() -> None:
    gpu = deployment("gpu")["spec"]["template"]["spec"]["containers"][0]["resources"]
    cpu = deployment("cpu")["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == 1 and "requests" in gpu
    assert "nvidia.com/gpu" not in cpu["limits"] and cpu["limits"]["cpu"] == cpu["requests"]["cpu"]


# --------------------------------------------------------------- against each other
def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def drain_seconds(env: dict[str, str]) -> float:
    fields = Settings.model_fields
    return float(env.get("TENSORSERVE_DRAIN_DELAY_S", fields["drain_delay_s"].default)) + float(
        env.get("TENSORSERVE_SHUTDOWN_GRACE_S", fields["shutdown_grace_s"].default)
    )


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_the_grace_period_covers_the_drain(variant: str) -> None:
    pod = deployment(variant)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= drain_seconds(container_env(pod["containers"][0])) + 5


def test_every_tensorserve_variable_in_the_manifests_is_a_setting() -> None:
    containers = [deployment(v)["spec"]["template"]["spec"]["containers"][0] for v in ("gpu", "cpu")]
    (runtime,) = documents(DEPLOY / "kserve" / "servingruntime.yaml")
    containers += runtime["spec"]["containers"]
    for container in containers:
        env = container_env(container)
        names = {k.removeprefix("TENSORSERVE_").lower(): v for k, v in env.items()}
        assert set(names) <= set(Settings.model_fields), names
        Settings.model_validate(names)


def test_service_podmonitor_and_probes_name_the_deployments_port_and_labels() -> None:
    doc = deployment("gpu")
    labels = doc["spec"]["template"]["metadata"]["labels"]
    container = doc["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    (service,) = documents(DEPLOY / "kubernetes" / "base" / "service.yaml")
    (monitor,) = documents(DEPLOY / "kubernetes" / "base" / "podmonitor.yaml")
    assert service["spec"]["selector"].items() <= labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == container["ports"][0]["containerPort"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"


def test_the_probe_and_metrics_paths_answer_on_a_real_server(server_url: str) -> None:
    container = deployment("gpu")["spec"]["template"]["spec"]["containers"][0]
    (monitor,) = documents(DEPLOY / "kubernetes" / "base" / "podmonitor.yaml")
    paths = [container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    paths.append(monitor["spec"]["podMetricsEndpoints"][0]["path"])
    for path in paths:
        with urllib.request.urlopen(server_url + path, timeout=10) as reply:
            assert reply.status == 200, path


def test_the_autoscaler_metrics_come_from_adapter_rules_over_real_series(server_url: str) -> None:
    (hpa,) = documents(DEPLOY / "kubernetes" / "base" / "hpa.yaml")
    (adapter,) = documents(DEPLOY / "kubernetes" / "prometheus-adapter" / "rules.yaml")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"]: rule["seriesQuery"].split("{")[0].strip("'") for rule in rules}
    wanted = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert wanted and set(wanted) <= set(served)
    with urllib.request.urlopen(server_url + "/metrics", timeout=10) as reply:
        exposition = reply.read().decode()
    for series in served.values():
        assert f"\n{series}" in exposition or exposition.startswith(series), series


def test_the_keda_scaler_queries_are_checked_ones_over_real_series(server_url: str) -> None:
    (scaler,) = documents(DEPLOY / "kubernetes" / "keda" / "scaledobject.yaml")
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment("gpu")["metadata"]["name"])
    queries = [t["metadata"]["query"] for t in scaler["spec"]["triggers"]]
    # Each is one of the docs' PromQL, which a real Prometheus evaluates in CI.
    documented = {q.expr for q in checker().docs_queries()}
    assert queries and set(queries) <= documented, set(queries) - documented
    with urllib.request.urlopen(server_url + "/metrics", timeout=10) as reply:
        exposition = reply.read().decode()
    for name in {n for q in queries for n in re.findall(r"\bnv_[a-z_]+", q)}:
        assert f"\n{name}{{" in exposition, name


def test_the_kserve_runtime_serves_the_inference_service() -> None:
    (runtime,) = documents(DEPLOY / "kserve" / "servingruntime.yaml")
    (isvc,) = documents(DEPLOY / "kserve" / "inferenceservice.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"] == ["v2"]
    container = runtime["spec"]["containers"][0]
    env = container_env(container)
    assert env["TENSORSERVE_MODEL_REPOSITORY"] == "/mnt/models"  # where KServe puts storageUri
    assert int(env["TENSORSERVE_PORT"]) == container["ports"][0]["containerPort"] == 8080
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_the_shipped_schemas_say_where_they_come_from() -> None:
    readme = (DEPLOY / "schemas" / "README.md").read_text()
    for name in CRD_SCHEMAS.values():
        assert name in readme
        assert (DEPLOY / "schemas" / name).stat().st_size > 1000
