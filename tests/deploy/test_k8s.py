"""Static checks of deploy/k8s: every overlay builds, validates against the Kubernetes OpenAPI
schemas, passes the security and operations policy, and agrees with the app it deploys.

No cluster runs here; what a cluster would check at admission (schemas) and what the app needs
(its routes, port, metric names, drain timeout) are checked instead, the latter against the real
app: a live server started with an overlay's ConfigMap as its environment.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from service.cli import CONNECTION_GRACE_S
from service.settings import Settings
from tests.deploy import kustomize
from tests.deploy.kustomize import Manifest
from tests.live_server import live_server
from tests.tls import make_certificates, tls_live_server

REPO_ROOT = Path(__file__).resolve().parents[2]

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted(path.name for path in (K8S_DIR / "overlays").iterdir() if path.is_dir())
# The oldest release the manifests are meant for (autoscaling/v2, policy/v1) and the newest the
# validator knows.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
# Seconds left for the process to exit once the drain and uvicorn's connection grace are over.
MIN_EXIT_MARGIN_S = 5
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
API_KEY = "k8s-test-key"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    name: str = request.param
    return name, kustomize.build_overlay(K8S_DIR / "overlays" / name)


def one(objects: list[Manifest], kind: str) -> Manifest:
    matching = [obj for obj in objects if obj["kind"] == kind]
    assert len(matching) == 1, f"expected one {kind}, found {len(matching)}"
    return matching[0]


def pod_spec(objects: list[Manifest]) -> dict[str, Any]:
    spec: dict[str, Any] = one(objects, "Deployment")["spec"]["template"]["spec"]
    return spec


def server_container(objects: list[Manifest]) -> dict[str, Any]:
    container: dict[str, Any] = pod_spec(objects)["containers"][0]
    return container


def configured_settings(objects: list[Manifest]) -> Settings:
    """The settings the ConfigMap gives the server (the Secret's key aside), as the server reads them."""
    data = one(objects, "ConfigMap")["data"]
    return Settings(**{name.removeprefix("PE_SERVE_").lower(): value for name, value in data.items()})


def containers(objects: list[Manifest]) -> Iterator[dict[str, Any]]:
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        yield from spec.get("initContainers", [])
        yield from spec.get("containers", [])


# -- building and schemas -------------------------------------------------------------------------


@pytest.mark.skipif(kustomize.kubectl() is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", OVERLAYS)
def test_the_test_builder_builds_what_kubectl_kustomize_builds(name: str) -> None:
    directory = K8S_DIR / "overlays" / name

    def by_identity(objects: list[Manifest]) -> dict[tuple[str, str], Manifest]:
        return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}

    assert by_identity(kustomize.build(directory)) == by_identity(kustomize.build_with_kubectl(directory))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
    overlay: tuple[str, list[Manifest]], version: str
) -> None:
    _, objects = overlay
    assert {obj["kind"] for obj in objects} >= {
        "ConfigMap",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_rejects_a_misspelt_field(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    broken = copy.deepcopy(one(objects, "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


# -- policy ---------------------------------------------------------------------------------------


def test_policy_no_privilege_non_root_read_only(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    pod = pod_spec(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod.get("hostNetwork", False) is False and pod.get("hostPID", False) is False
    assert pod["automountServiceAccountToken"] is False
    for container in containers(objects):
        context = container["securityContext"]
        assert context.get("privileged", False) is False
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"]["drop"] == ["ALL"]
        assert not context["capabilities"].get("add")


def test_policy_resources_and_probes_set(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    for container in containers(objects):
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][bound]), (container["name"], bound)
    server = server_container(objects)
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(server)


def test_policy_no_secret_in_the_manifests(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    assert all(obj["kind"] != "Secret" for obj in objects)
    for name in one(objects, "ConfigMap")["data"]:
        assert not SECRET_NAME.search(name), f"{name} belongs in a Secret"
    for container in containers(objects):
        for variable in container.get("env", []):
            if SECRET_NAME.search(variable["name"]):
                assert "value" not in variable, f"{variable['name']} is written into the manifest"
                assert "secretKeyRef" in variable["valueFrom"]


def test_the_api_key_comes_from_a_secret(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    variables = {variable["name"]: variable for variable in server_container(objects)["env"]}
    reference = variables["PE_SERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert reference["name"] == "pe-serve-api-key" and reference["key"] == "api-key"


def tls_files(objects: list[Manifest]) -> dict[str, str]:
    """The server's TLS flags (`--tls-cert`, `--tls-key`) and the files they name."""
    server = server_container(objects)
    assert server["command"] == ["pe-serve"]
    arguments = server["args"]
    return dict(zip(arguments[::2], arguments[1::2], strict=True))


def test_tls_certificate_and_key_come_from_a_secret(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    files = tls_files(objects)
    assert set(files) == {"--tls-cert", "--tls-key"}
    volumes = {volume["name"]: volume for volume in pod_spec(objects)["volumes"]}
    (mount,) = [m for m in server_container(objects)["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert volumes[mount["name"]]["secret"]["secretName"] == "pe-serve-tls" and mount["readOnly"] is True
    # A kubernetes.io/tls Secret's two keys, under the mount.
    assert files == {
        "--tls-cert": f"{mount['mountPath']}/tls.crt",
        "--tls-key": f"{mount['mountPath']}/tls.key",
    }
    server = server_container(objects)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"]["scheme"] == "HTTPS"
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scheme"] == "https"


# -- agreement with the app -----------------------------------------------------------------------


def test_the_grace_period_covers_prestop_drain_and_exit(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    drain_timeout_s = configured_settings(objects).drain_timeout_s
    pre_stop = server_container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod_spec(objects)["terminationGracePeriodSeconds"]
    assert grace >= int(pre_stop[1]) + drain_timeout_s + CONNECTION_GRACE_S + MIN_EXIT_MARGIN_S


def test_the_gpu_overlay_asks_for_one_gpu_and_the_cpu_overlay_none(
    overlay: tuple[str, list[Manifest]],
) -> None:
    name, objects = overlay
    resources = server_container(objects)["resources"]
    device = configured_settings(objects).device
    if name == "cpu":
        assert "nvidia.com/gpu" not in resources["limits"] and device == "cpu"
    else:
        assert resources["limits"]["nvidia.com/gpu"] == 1 and device == "cuda"


def test_service_port_scrape_target_and_autoscaler_name_the_app(overlay: tuple[str, list[Manifest]]) -> None:
    _, objects = overlay
    port = server_container(objects)["ports"][0]
    assert port["containerPort"] == configured_settings(objects).port
    service = one(objects, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"] == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    autoscaler = one(objects, "HorizontalPodAutoscaler")
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == one(objects, "Deployment")["metadata"]["name"]
    assert autoscaler["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pe_serve_queue_depth"


def test_probes_and_scrape_path_answer_on_a_server_run_with_the_configmap(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The ConfigMap as the environment, the Secrets' key and certificate given: probes answer
    over HTTPS without the key."""
    objects = kustomize.build_overlay(K8S_DIR / "overlays" / "cpu")
    server = server_container(objects)
    environment = {**one(objects, "ConfigMap")["data"], "PE_SERVE_API_KEY": API_KEY}
    # Host, port and threads are this machine's; everything else is the manifest's. The TLS files
    # are made here, where the Secret's mount would put them in the pod.
    options = {"torch_threads": 1, "max_context": 512}
    certificates = make_certificates(tmp_path)
    with (
        tls_live_server([tiny_checkpoints["rope"]], certificates, options=options, env=environment) as served,
        httpx.Client(base_url=served.url, verify=served.client_context(certificates)) as client,
    ):
        paths = {
            "startupProbe": server["startupProbe"]["httpGet"]["path"],
            "readinessProbe": server["readinessProbe"]["httpGet"]["path"],
            "livenessProbe": server["livenessProbe"]["httpGet"]["path"],
        }
        assert paths == {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
        for path in paths.values():
            assert client.get(path, timeout=10).status_code == 200
        scrape_path = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"][
            "prometheus.io/path"
        ]
        metrics = client.get(scrape_path, timeout=10)
        assert metrics.status_code == 200 and "pe_serve_queue_depth" in metrics.text
        assert client.get("/models", timeout=10).status_code == 401
        authorised = client.get("/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert authorised.status_code == 200


def test_the_monitoring_extras_match_the_service_and_the_autoscaler(
    overlay: tuple[str, list[Manifest]],
) -> None:
    """The ServiceMonitor (a CRD, outside the schemas) and the adapter rule name what the base has."""
    _, objects = overlay
    monitoring = K8S_DIR / "monitoring"
    monitor = yaml.safe_load((monitoring / "servicemonitor.yaml").read_text())
    service = one(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert endpoint["path"] == annotations["prometheus.io/path"]
    (rule,) = yaml.safe_load((monitoring / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    metric = one(objects, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert rule["name"]["as"] == metric and rule["seriesQuery"].startswith(metric + "{")


def read_only_root_launcher(writable: list[str], keep: Path) -> list[str]:
    """A private mount namespace with `/` read-only and a fresh tmpfs on each `writable` path.

    `keep` (the checkout, with its virtual environment) stays visible even where it lies under a
    writable path (a clone in /tmp): a descriptor opened on it before the tmpfs hides it is bound
    back at the same place afterwards, still read-only.
    """
    mounts = " && ".join(f"mount -t tmpfs -o size=1g tmpfs {path}" for path in writable)
    hidden = any(keep.is_relative_to(path) for path in writable)
    restore = (
        f' && mkdir -p "{keep}" && mount --no-canonicalize --bind /proc/self/fd/3 "{keep}"'
        f' && mount -o remount,bind,ro "{keep}"'
        if hidden
        else ""
    )
    script = (
        f'exec 3<"{keep}" && mount --bind / / && mount -o remount,bind,ro / && {mounts}{restore} && '
        # Proof that the root really is read-only before the server starts.
        'if touch "$PWD/.read-only-probe" 2>/dev/null; then exit 97; fi && exec 3<&- && exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def _can_make_mount_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_make_mount_namespaces(), reason="needs root and mount namespaces (unshare)")
def test_the_server_runs_on_a_read_only_root_with_only_the_manifest_s_writable_mounts() -> None:
    """What readOnlyRootFilesystem plus the emptyDir mounts give the container, on this machine."""
    objects = kustomize.build_overlay(K8S_DIR / "overlays" / "cpu")
    volumes = {volume["name"]: volume for volume in pod_spec(objects)["volumes"]}
    writable = [
        mount["mountPath"]
        for mount in server_container(objects)["volumeMounts"]
        if "emptyDir" in volumes[mount["name"]]
    ]
    assert sorted(writable) == ["/dev/shm", "/tmp"]
    environment = {**one(objects, "ConfigMap")["data"], "PYTHONDONTWRITEBYTECODE": "1"}
    # The bundled checkpoints: pytest's own temporary directories lie under the hidden /tmp.
    model = REPO_ROOT / "models" / "zoo-rope"
    with live_server(
        [model],
        options={"torch_threads": 1},
        env=environment,
        launcher=read_only_root_launcher(writable, REPO_ROOT),
    ) as running:
        body = {
            "prompt": "def f(x):",
            "pe_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
            "max_new_tokens": 8,
            "seed": 3,
            "temperature": 0.8,
        }
        response = httpx.post(running.url("/generate"), json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert running.stop() == 0
        assert "Read-only file system" not in running.logs()
