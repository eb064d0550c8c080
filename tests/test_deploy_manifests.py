"""Every manifest under deploy/ is validated: Kubernetes' own kinds against
the Kubernetes schemas that ``kubernetes-validate`` bundles (offline,
strict: an unknown field is an error), the KServe and Prometheus-operator
kinds against the CRD schemas shipped in deploy/schemas/ (with
``jsonschema``, made strict the same way). The kustomize overlays are
rendered here as ``kubectl kustomize`` renders them (their patches are JSON
6902 operations, applied with ``jsonpatch``), and every rendered object is
validated too. Then the manifests are checked against each other and
against the server: probes, ports, the drain, the autoscaler's metrics, the
CPU quota the server sizes its threads from."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

import jsonpatch
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tensorserve.repository.loader import discover
from tensorserve.host import available_cpus
from tensorserve.settings import Settings
from tests.conftest import ROOT
from tests.test_observability_docs import checker

DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
ADAPTER_VALUES = KUBERNETES / "prometheus-adapter" / "values.yaml"
KUBERNETES_VERSIONS = ["1.29", "1.37"]  # the oldest and newest the checks pin
CRD_SCHEMAS = {  # (apiVersion, kind) -> the file in deploy/schemas/
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "kserve-servingruntime-v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "kserve-inferenceservice-v1beta1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring-podmonitor-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject-v1alpha1.json",
}
VARIANTS = ["gpu", "cpu"]
EXAMPLES = ["examples/models-from-pvc", "examples/models-from-image"]
GPU_TAINT = "nvidia.com/gpu"


def documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# --------------------------------------------------------------- kustomize
def kustomization_folders() -> list[Path]:
    return sorted(p.parent for p in KUBERNETES.rglob("kustomization.yaml"))


def kustomization(folder: Path) -> dict[str, Any]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    # What the renderer below implements; anything else would be silently ignored.
    assert set(spec) <= {"apiVersion", "kind", "resources", "patches"}, folder
    for patch in spec.get("patches", []):
        assert set(patch) == {"path", "target"} and set(patch["target"]) == {"kind", "name"}, patch
    return spec


def patch_files() -> set[Path]:
    return {
        (folder / patch["path"]).resolve()
        for folder in kustomization_folders()
        for patch in kustomization(folder).get("patches", [])
    }


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize folder`` renders from its resources (files and
    other kustomizations) and its JSON 6902 patches, each on the object its
    target names. A patch whose target is missing, or whose operation does
    not apply (a path that is not there to replace), is an error, as it is
    for kustomize."""
    spec = kustomization(folder)
    rendered: list[dict[str, Any]] = []
    for entry in spec["resources"]:
        target = folder / entry
        rendered += kustomize(target) if target.is_dir() else documents(target)
    for patch in spec.get("patches", []):
        operations = yaml.safe_load((folder / patch["path"]).read_text())
        assert isinstance(operations, list), f"{patch['path']}: JSON 6902 operations"
        kind, name = patch["target"]["kind"], patch["target"]["name"]
        hits = [i for i, d in enumerate(rendered) if (d["kind"], d["metadata"]["name"]) == (kind, name)]
        assert hits, f"{folder}: no {kind}/{name} to patch"
        for i in hits:
            rendered[i] = jsonpatch.apply_patch(rendered[i], operations)
    return rendered


def rendered_kind(folder: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in kustomize(KUBERNETES / folder) if d["kind"] == kind]
    return doc


def deployment(folder: str) -> dict[str, Any]:
    return rendered_kind(folder, "Deployment")


def pod_spec(folder: str) -> dict[str, Any]:
    return deployment(folder)["spec"]["template"]["spec"]


def server_container(folder: str) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(folder)["containers"] if c["name"] == "tensorserve"]
    return container


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_renders_the_shared_objects_and_its_deployment(variant: str) -> None:
    rendered = kustomize(KUBERNETES / variant)
    assert sorted(d["kind"] for d in rendered) == [
        "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "PodMonitor", "Service"
    ]
    kubectl = shutil.which("kubectl")
    if kubectl is not None:  # where kubectl is installed, it renders the same objects
        out = subprocess.run(
            [kubectl, "kustomize", str(KUBERNETES / variant)],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        by_key = lambda docs: {(d["kind"], d["metadata"]["name"]): d for d in docs}
        assert by_key(yaml.safe_load_all(out)) == by_key(rendered)


def test_the_variants_patch_the_base_instead_of_copying_it() -> None:
    # One Deployment file; the variants hold only operations on it.
    deployments = [p for p in KUBERNETES.rglob("*.yaml") if p.resolve() not in patch_files()
                   and any(d.get("kind") == "Deployment" for d in documents(p) if isinstance(d, dict))]
    assert deployments == [KUBERNETES / "base" / "deployment.yaml"]
    for variant in VARIANTS:
        assert kustomization(KUBERNETES / variant)["resources"] == ["../base"]


def test_a_patch_that_does_not_apply_is_an_error(tmp_path: Path) -> None:
    # The renderer is strict as kustomize is: a replace of a missing path, or
    # a target that names nothing, fails instead of rendering the base unpatched.
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "patch.yaml").write_text(yaml.safe_dump(
        [{"op": "replace", "path": "/spec/template/spec/nodeName", "value": "gpu-node-1"}]
    ))
    for target in ({"kind": "Deployment", "name": "tensorserve"}, {"kind": "Deployment", "name": "other"}):
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [str(KUBERNETES / "base")],
            "patches": [{"path": "patch.yaml", "target": target}],
        }))
        with pytest.raises((jsonpatch.JsonPatchException, AssertionError)):
            kustomize(overlay)


def test_the_cpu_deployment_differs_from_the_gpu_one_only_in_image_resources_tolerations_and_device() -> None:
    gpu, cpu = deployment("gpu"), deployment("cpu")
    for doc in (gpu, cpu):
        pod = doc["spec"]["template"]["spec"]
        pod.pop("tolerations", None)
        container = pod["containers"][0]
        container.pop("image")
        container.pop("resources")
        # The device setting (cuda on the GPU variant) is the variant's to choose.
        container["env"] = [e for e in container["env"] if e["name"] != "TENSORSERVE_DEVICE"]
    assert gpu == cpu
    assert deployment("gpu")["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-gpu")
    assert deployment("cpu")["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-cpu")


# --------------------------------------------------------------- validation
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


def object_files() -> list[Path]:
    """Files of Kubernetes objects: not kustomizations, patches, schemas, or
    the adapter's rules (a Helm values snippet, not an object)."""
    skip = patch_files() | {ADAPTER_VALUES.resolve()}
    return sorted(
        p for p in DEPLOY.rglob("*.yaml")
        if p.name != "kustomization.yaml" and "schemas" not in p.parts and p.resolve() not in skip
    )


def all_objects() -> list[tuple[str, dict[str, Any]]]:
    """Every object as a file holds it and as each kustomization renders it."""
    found = [(str(p.relative_to(ROOT)), doc) for p in object_files() for doc in documents(p)]
    for folder in kustomization_folders():
        where = f"kustomize {folder.relative_to(ROOT)}"
        found += [(where, doc) for doc in kustomize(folder)]
    return found


def test_every_kustomization_is_rendered_here() -> None:
    names = {str(f.relative_to(KUBERNETES)) for f in kustomization_folders()}
    assert names == {"base", *VARIANTS, *EXAMPLES}


@pytest.mark.parametrize("where, doc", all_objects(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_object_is_valid(where: str, doc: dict[str, Any]) -> None:
    validate(doc)


def test_the_manifests_cover_what_a_deployment_needs() -> None:
    kinds = sorted({doc["kind"] for _, doc in all_objects()})
    assert kinds == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "InferenceService",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "PodMonitor",
        "ScaledObject",
        "Service",
        "ServingRuntime",
    ]
    # No ConfigMap: the adapter's rules are merged into the cluster's config,
    # never shipped as a config that would replace it.
    assert not [d for _, d in all_objects() if d["kind"] == "ConfigMap"]


@pytest.mark.parametrize(
    "where, path, value",
    [
        ("kubernetes/base/deployment.yaml", ["spec", "template", "spec", "containers", 0, "imagePullPolcy"], "Always"),
        ("kubernetes/base/deployment.yaml", ["spec", "template", "spec", "terminationGracePeriodSeconds"], "30s"),
        ("kubernetes/base/deployment.yaml", ["spec", "template", "spec", "topologySpreadConstraints", 0, "whenUnsatisfiable"], None),
        ("kubernetes/base/pdb.yaml", ["spec", "maxUnavailabe"], 1),
        ("kserve/servingruntime.yaml", ["spec", "protocolVersion"], "v2"),
        ("kserve/servingruntime.yaml", ["spec", "supportedModelFormats", 0, "autoselect"], True),
        ("kserve/servingruntime.yaml", ["spec", "tolerations", 0, "operator"], 1),
        ("kserve/inferenceservice.yaml", ["spec", "predictor", "model", "storageURI"], "s3://x"),
        ("kubernetes/base/podmonitor.yaml", ["spec", "podMetricsEndpoints", 0, "interval"], 15),
        ("kubernetes/base/hpa.yaml", ["spec", "maxReplicas"], "eight"),
        ("kubernetes/examples/models-from-pvc/pvc.yaml", ["spec", "accessMode"], ["ReadOnlyMany"]),
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


def test_a_mistake_in_a_patch_fails_validation_once_rendered(tmp_path: Path) -> None:
    # A misspelt field in a patch's value renders fine; the rendered object fails.
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "patch.yaml").write_text(yaml.safe_dump(
        [{"op": "add", "path": "/spec/template/spec/toleration", "value": [{"key": GPU_TAINT}]}]
    ))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(KUBERNETES / "gpu")],
        "patches": [{"path": "patch.yaml", "target": {"kind": "Deployment", "name": "tensorserve"}}],
    }))
    (doc,) = [d for d in kustomize(overlay) if d["kind"] == "Deployment"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(doc)


# --------------------------------------------------------------- scheduling
def pod_labels(folder: str) -> dict[str, str]:
    return deployment(folder)["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("folder", VARIANTS + EXAMPLES)
def test_replicas_spread_over_zones_and_nodes_without_ever_staying_pending(folder: str) -> None:
    constraints = pod_spec(folder)["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in constraints} == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
    for constraint in constraints:
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"
        # The selector counts this Deployment's own pods, and nothing else.
        assert constraint["labelSelector"]["matchLabels"].items() <= pod_labels(folder).items()


def test_the_disruption_budget_covers_the_pods_and_lets_a_single_replica_node_drain() -> None:
    pdb = rendered_kind("gpu", "PodDisruptionBudget")
    hpa = rendered_kind("gpu", "HorizontalPodAutoscaler")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels("gpu").items()
    # minAvailable: 1 with minReplicas: 1 would refuse every eviction of the pod.
    assert "minAvailable" not in pdb["spec"] and pdb["spec"]["maxUnavailable"] == 1
    assert hpa["spec"]["minReplicas"] >= 1


def gpu_pods() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """(where, pod-level spec, containers with the resources they get) of
    every pod that runs the GPU image: the Deployments, and the KServe
    runtime with its InferenceService's resources (which replace the runtime's)."""
    pods = [(f, pod_spec(f), pod_spec(f)["containers"]) for f in ["gpu", *EXAMPLES]]
    (runtime,) = documents(DEPLOY / "kserve" / "servingruntime.yaml")
    (isvc,) = documents(DEPLOY / "kserve" / "inferenceservice.yaml")
    container = dict(runtime["spec"]["containers"][0])
    pods.append(("kserve runtime", runtime["spec"], [container]))
    pods.append(("kserve runtime + inference service", runtime["spec"],
                 [{**container, "resources": isvc["spec"]["predictor"]["model"]["resources"]}]))
    return pods


@pytest.mark.parametrize("where, pod, containers", gpu_pods(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_gpu_pod_asks_for_a_gpu_and_tolerates_the_gpu_taint(
    where: str, pod: dict[str, Any], containers: list[dict[str, Any]]
) -> None:
    assert any(GPU_TAINT in c["resources"].get("limits", {}) for c in containers), where
    assert any(
        t["key"] == GPU_TAINT and t["operator"] == "Exists" and t.get("effect") in (None, "NoSchedule")
        for t in pod.get("tolerations", [])
    ), where
    assert "-gpu" in containers[0]["image"]


def test_the_cpu_variant_neither_asks_for_a_gpu_nor_tolerates_the_taint() -> None:
    assert GPU_TAINT not in server_container("cpu")["resources"]["limits"]
    assert "tolerations" not in pod_spec("cpu")


def cpus(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def intra_op_threads(limit_cpus: float, tmp_path: Path, node_cores: int = 64) -> int:
    """What the server starts per model thread on a 64-core node under this
    CPU limit (the kubelet writes it as cgroup v2 cpu.max), by the server's
    own rule (runtime/device.py: the CPUs it may use, less one)."""
    (tmp_path / "cgroup").mkdir(exist_ok=True)
    (tmp_path / "cgroup" / "cpu.max").write_text(f"{round(limit_cpus * 100000)} 100000\n")
    (tmp_path / "self_cgroup").write_text("0::/\n")
    return max(1, available_cpus(tmp_path / "cgroup", tmp_path / "self_cgroup", cores=node_cores) - 1)


def server_containers() -> list[tuple[str, dict[str, Any]]]:
    found = [(f, server_container(f)) for f in VARIANTS + EXAMPLES]
    found += [(w, c[0]) for w, _, c in gpu_pods() if w.startswith("kserve")]
    return found


@pytest.mark.parametrize("where, container", server_containers(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_server_has_a_whole_cpu_limit_equal_to_its_request(
    where: str, container: dict[str, Any], tmp_path: Path
) -> None:
    resources = container["resources"]
    limit, request = cpus(resources["limits"]["cpu"]), cpus(resources["requests"]["cpu"])
    # Whole: the server rounds a quota up (1.5 -> 2 threads), oversubscribing it.
    # Equal: the request is what the scheduler reserves, the limit what the threads assume.
    assert limit == request and limit == int(limit), where
    # At least 2: one core for the event loop, at least one intra-op thread.
    assert 2 <= limit and intra_op_threads(limit, tmp_path) == limit - 1 < 64 - 1


def test_without_a_limit_a_model_thread_would_take_the_node(tmp_path: Path) -> None:
    # Why the limit matters: no cpu.max quota reads as every core of the node.
    (tmp_path / "cgroup").mkdir()
    (tmp_path / "cgroup" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "self_cgroup").write_text("0::/\n")
    assert available_cpus(tmp_path / "cgroup", tmp_path / "self_cgroup", cores=64) - 1 == 63
    assert intra_op_threads(4, tmp_path) == 3


# --------------------------------------------------------------- your own models
IMAGE_MODEL_REPOSITORY = "/models"  # the Dockerfile's TENSORSERVE_MODEL_REPOSITORY


def test_the_image_serves_the_folder_the_examples_mount() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"TENSORSERVE_MODEL_REPOSITORY={IMAGE_MODEL_REPOSITORY}" in dockerfile


def test_the_pvc_example_mounts_its_claim_read_only_where_the_server_looks() -> None:
    rendered = kustomize(KUBERNETES / "examples/models-from-pvc")
    (claim,) = [d for d in rendered if d["kind"] == "PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in pod_spec("examples/models-from-pvc")["volumes"]}
    (mount,) = server_container("examples/models-from-pvc")["volumeMounts"]
    assert mount["mountPath"] == IMAGE_MODEL_REPOSITORY and mount["readOnly"] is True
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # Several replicas on several nodes read one claim.
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_the_init_container_example_fills_the_volume_the_server_reads() -> None:
    pod = pod_spec("examples/models-from-image")
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (served,) = server_container("examples/models-from-image")["volumeMounts"]
    (filled,) = init["volumeMounts"]
    assert served["name"] == filled["name"] and "emptyDir" in volumes[served["name"]]
    assert served["mountPath"] == IMAGE_MODEL_REPOSITORY and served.get("readOnly") is True
    # It copies the repository's contents (not the folder itself) to the volume's root.
    assert init["command"][-2:] == [f"{IMAGE_MODEL_REPOSITORY}/.", f"{filled['mountPath']}/"]
    assert init["resources"]["limits"]["cpu"] == init["resources"]["requests"]["cpu"]


def test_a_repository_archived_as_documented_unpacks_as_kserve_does_into_the_same_models(
    tmp_path: Path,
) -> None:
    # docs/deployment.md: `tar -C model_repository -czf models.tar.gz .` KServe's
    # storage initializer, given one .tar.gz (or .tgz, .zip) object, extracts it
    # into /mnt/models and deletes it (kserve/storage: _unpack_archive_file).
    archive = tmp_path / "models.tar.gz"
    subprocess.run(["tar", "-C", str(ROOT / "model_repository"), "-czf", str(archive), "."], check=True)
    mnt_models = tmp_path / "mnt" / "models"
    mnt_models.mkdir(parents=True)
    with tarfile.open(archive, "r", encoding="utf-8") as tar:
        tar.extractall(mnt_models, filter="data")
    served = discover(mnt_models)
    expected = discover(ROOT / "model_repository")
    assert served and {n: s.versions for n, s in served.items()} == {n: s.versions for n, s in expected.items()}
    for source in served.values():  # the same files, byte for byte
        version = source.path / str(source.latest)
        original = ROOT / "model_repository" / source.name / str(source.latest)
        files = sorted(p.name for p in version.iterdir() if p.name != "__pycache__")
        assert files and files == sorted(p.name for p in original.iterdir() if p.name != "__pycache__")
        assert all((version / f).read_bytes() == (original / f).read_bytes() for f in files)
    # Archiving the folder itself instead adds a level: no model is found.
    wrong = tmp_path / "wrong.tar.gz"
    subprocess.run(["tar", "-C", str(ROOT), "-czf", str(wrong), "model_repository"], check=True)
    (tmp_path / "wrong").mkdir()
    with tarfile.open(wrong, "r", encoding="utf-8") as tar:
        tar.extractall(tmp_path / "wrong", filter="data")
    assert discover(tmp_path / "wrong") == {}


def test_the_gpu_pods_require_cuda_and_the_cpu_one_does_not() -> None:
    # A GPU pod that finds no CUDA fails its models rather than serve on the CPU.
    def env(container: dict[str, Any]) -> list[dict[str, Any]]:
        return container.get("env", [])

    cuda = {"name": "TENSORSERVE_DEVICE", "value": "cuda"}
    assert cuda in env(pod_spec("gpu")["containers"][0])
    assert cuda not in env(pod_spec("cpu")["containers"][0])
    (runtime,) = documents(DEPLOY / "kserve" / "servingruntime.yaml")
    assert cuda in env(runtime["spec"]["containers"][0])


# --------------------------------------------------------------- against each other
def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def drain_seconds(env: dict[str, str]) -> float:
    fields = Settings.model_fields
    return float(env.get("TENSORSERVE_DRAIN_DELAY_S", fields["drain_delay_s"].default)) + float(
        env.get("TENSORSERVE_SHUTDOWN_GRACE_S", fields["shutdown_grace_s"].default)
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_grace_period_covers_the_drain(variant: str) -> None:
    pod = pod_spec(variant)
    assert pod["terminationGracePeriodSeconds"] >= drain_seconds(container_env(pod["containers"][0])) + 5


def test_every_tensorserve_variable_in_the_manifests_is_a_setting() -> None:
    for where, container in server_containers():
        env = container_env(container)
        names = {k.removeprefix("TENSORSERVE_").lower(): v for k, v in env.items()}
        assert set(names) <= set(Settings.model_fields), (where, names)
        Settings.model_validate(names)


def test_service_podmonitor_and_probes_name_the_deployments_port_and_labels() -> None:
    doc = deployment("gpu")
    labels = doc["spec"]["template"]["metadata"]["labels"]
    container = doc["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    service, monitor = rendered_kind("gpu", "Service"), rendered_kind("gpu", "PodMonitor")
    assert service["spec"]["selector"].items() <= labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    http = next(p for p in container["ports"] if p["name"] == "http")
    assert int(annotations["prometheus.io/port"]) == http["containerPort"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"


def test_the_podmonitor_carries_the_label_kube_prometheus_stack_selects() -> None:
    # kube-prometheus-stack's Prometheus selects PodMonitors by `release: <its
    # Helm release>`; without the label nothing is scraped and the HPA sees no metric.
    monitor = rendered_kind("gpu", "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "release: kube-prometheus-stack" in (ROOT / "docs" / "deployment.md").read_text()


def test_the_probe_and_metrics_paths_answer_on_a_real_server(server_url: str) -> None:
    container = server_container("gpu")
    monitor = rendered_kind("gpu", "PodMonitor")
    paths = [container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    paths.append(monitor["spec"]["podMetricsEndpoints"][0]["path"])
    for path in paths:
        with urllib.request.urlopen(server_url + path, timeout=10) as reply:
            assert reply.status == 200, path


# --------------------------------------------------------------- the adapter's rules
def adapter_rules() -> list[dict[str, Any]]:
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def merge_script() -> Any:
    spec = importlib.util.spec_from_file_location("merge_adapter_rules", ROOT / "scripts" / "merge_adapter_rules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_autoscaler_metrics_come_from_adapter_rules_over_real_series(server_url: str) -> None:
    hpa = rendered_kind("gpu", "HorizontalPodAutoscaler")
    served = {rule["name"]["as"]: rule["seriesQuery"].split("{")[0].strip("'") for rule in adapter_rules()}
    wanted = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert wanted and set(wanted) <= set(served)
    with urllib.request.urlopen(server_url + "/metrics", timeout=10) as reply:
        exposition = reply.read().decode()
    for series in served.values():
        assert f"\n{series}" in exposition or exposition.startswith(series), series
    # In flight is one series per pod, with no model label (docs/operations.md).
    assert "\ntensorserve_requests_in_flight " in exposition


# kube-prometheus's adapter config: the resource rules behind `kubectl top`.
KUBE_PROMETHEUS_ADAPTER_CONFIG = """\
resourceRules:
  cpu:
    containerQuery: sum by (<<.GroupBy>>) (irate(container_cpu_usage_seconds_total{<<.LabelMatchers>>,container!="",pod!=""}[120s]))
    nodeQuery: sum by (<<.GroupBy>>) (1 - irate(node_cpu_seconds_total{mode="idle"}[60s]))
    resources:
      overrides:
        namespace: {resource: namespace}
        node: {resource: node}
        pod: {resource: pod}
    containerLabel: container
  window: 5m
rules:
  - seriesQuery: 'http_requests_total{namespace!="",pod!=""}'
    resources: {template: <<.Resource>>}
    name: {matches: "^(.*)_total$", as: "${1}_per_second"}
    metricsQuery: 'sum(rate(<<.Series>>{<<.LabelMatchers>>}[2m])) by (<<.GroupBy>>)'
"""


def test_merging_the_rules_keeps_the_clusters_own_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = merge_script()
    config = tmp_path / "config.yaml"
    config.write_text(KUBE_PROMETHEUS_ADAPTER_CONFIG)
    assert module.main([str(config)]) == 0
    merged = yaml.safe_load(capsys.readouterr().out)
    before = yaml.safe_load(KUBE_PROMETHEUS_ADAPTER_CONFIG)
    assert merged["resourceRules"] == before["resourceRules"]  # kubectl top still works
    assert merged["rules"] == before["rules"] + adapter_rules()
    # Twice is once: the same metric's rule is replaced, not added again.
    config.write_text(yaml.safe_dump(merged))
    assert module.main([str(config), "--patch"]) == 0
    patch = json.loads(capsys.readouterr().out)
    assert list(patch) == ["data"] and list(patch["data"]) == ["config.yaml"]
    assert yaml.safe_load(patch["data"]["config.yaml"]) == merged


def test_the_adapter_rules_are_shaped_as_the_adapter_reads_them() -> None:
    for rule in adapter_rules():
        assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


# --------------------------------------------------------------- KEDA
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


# --------------------------------------------------------------- KServe
def test_the_kserve_runtime_serves_the_inference_service() -> None:
    (runtime,) = documents(DEPLOY / "kserve" / "servingruntime.yaml")
    (isvc,) = documents(DEPLOY / "kserve" / "inferenceservice.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    container = runtime["spec"]["containers"][0]
    env = container_env(container)
    assert env["TENSORSERVE_MODEL_REPOSITORY"] == "/mnt/models"  # where KServe puts storageUri
    assert int(env["TENSORSERVE_PORT"]) == container["ports"][0]["containerPort"] == 8080
    # gRPC on the port KServe knows by its name, h2c.
    (grpc_port,) = [p for p in container["ports"] if p.get("name") == "h2c"]
    assert int(env["TENSORSERVE_GRPC_PORT"]) == grpc_port["containerPort"] == 8001
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_the_shipped_schemas_say_where_they_come_from() -> None:
    readme = (DEPLOY / "schemas" / "README.md").read_text()
    for name in CRD_SCHEMAS.values():
        assert name in readme
        assert (DEPLOY / "schemas" / name).stat().st_size > 1000
