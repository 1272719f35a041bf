"""The Kubernetes overlays ship the Namespace they deploy into, with Pod Security admission enforcing "restricted",
and every pod they define passes that profile's checks (so the namespace's admission lets them all in)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
PSA = "pod-security.kubernetes.io/"
# The "restricted" profile's volume types (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


@pytest.fixture(scope="module", params=["dev", "prod"])
def rendered(request) -> tuple[str, list[dict]]:
    """(the overlay's namespace, its built objects)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    overlay = K8S / "overlays" / request.param
    built = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True).stdout
    namespace = yaml.safe_load((overlay / "kustomization.yaml").read_text())["namespace"]
    return namespace, [doc for doc in yaml.safe_load_all(built) if doc]


def _pods(objects: list[dict]):
    for obj in objects:
        spec = obj.get("spec", {})
        if obj["kind"] == "PyTorchJob":
            yield from (replica["template"]["spec"] for replica in spec["pytorchReplicaSpecs"].values())
        elif obj["kind"] == "CronJob":
            yield spec["jobTemplate"]["spec"]["template"]["spec"]
        elif "template" in spec:
            yield spec["template"]["spec"]


def restricted_violations(pod: dict) -> list[str]:
    """What the "restricted" Pod Security profile refuses in ``pod`` (a pod spec); empty when it is admitted."""
    found = []
    pod_security = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            found.append(flag)
    found += [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    if pod_security.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for container in pod.get("initContainers", []) + pod["containers"] + pod.get("ephemeralContainers", []):
        name, security = container["name"], container.get("securityContext", {})
        if not security.get("runAsNonRoot", pod_security.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot not true")
        if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp}")
        if security.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        if security.get("privileged"):
            found.append(f"{name}: privileged")
        capabilities = security.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities {capabilities}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


def test_the_overlay_ships_its_namespace_enforcing_restricted(rendered):
    namespace, objects = rendered
    namespaces = [obj for obj in objects if obj["kind"] == "Namespace"]
    assert [obj["metadata"]["name"] for obj in namespaces] == [namespace]
    labels = namespaces[0]["metadata"]["labels"]
    assert labels[f"{PSA}enforce"] == labels[f"{PSA}audit"] == labels[f"{PSA}warn"] == "restricted"
    assert labels[f"{PSA}enforce-version"] == "v1.30"  # the oldest version the manifests are validated for
    namespaced = [obj for obj in objects if obj["kind"] != "Namespace"]
    assert {obj["metadata"].get("namespace") for obj in namespaced} == {namespace}


def test_every_pod_passes_the_restricted_profile(rendered):
    _, objects = rendered
    pods = list(_pods(objects))
    assert len(pods) >= 5
    assert {index: restricted_violations(pod) for index, pod in enumerate(pods) if restricted_violations(pod)} == {}


def test_the_checker_refuses_what_restricted_refuses():
    admitted = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {"name": "c", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    assert restricted_violations(admitted) == []
    root = {**admitted, "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}, "runAsUser": 0}}
    host = {**admitted, "volumes": [{"name": "h", "hostPath": {"path": "/"}}], "hostNetwork": True}
    escalating = {
        **admitted,
        "containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}],
    }
    assert len(restricted_violations(root)) == 3  # runAsNonRoot unset, runAsUser 0 on the pod and its container
    assert restricted_violations(host) == ["hostNetwork", "volume h"]
    assert len(restricted_violations(escalating)) == 2  # escalation allowed, a capability added and ALL not dropped
