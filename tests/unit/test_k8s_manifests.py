"""The Kubernetes manifests (kustomize overlays dev and prod): pinned images, no inline secrets, restart policies."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from core.errors import RETRYABLE_EXIT_CODE, UserError
from pipeline import launch

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)


def _documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_every_manifest_parses():
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 8
    for path in files:
        assert _documents(path.read_text()), path


@pytest.fixture(scope="module", params=["dev", "prod"])
def overlay(request) -> dict:
    """The built overlay's objects by (kind, name)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / request.param)], capture_output=True, text=True, check=True
    ).stdout
    objects = {(doc["kind"], doc["metadata"]["name"]): doc for doc in _documents(built)}
    objects["overlay"] = request.param
    return objects


def _pod_specs(objects: dict):
    for key, obj in objects.items():
        if key == "overlay":
            continue
        spec = obj.get("spec", {})
        if obj["kind"] == "PyTorchJob":
            yield from (replica["template"]["spec"] for replica in spec["pytorchReplicaSpecs"].values())
        elif obj["kind"] == "CronJob":
            yield spec["jobTemplate"]["spec"]["template"]["spec"]
        elif "template" in spec:
            yield spec["template"]["spec"]


def _containers(objects: dict):
    for pod in _pod_specs(objects):
        yield from pod.get("initContainers", []) + pod["containers"]


def test_images_are_pinned_to_a_tag_that_is_not_latest(overlay):
    images = [container["image"] for container in _containers(overlay)]
    assert len(images) >= 4
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag not in ("", "latest"), image


def test_no_secret_value_is_written_into_a_manifest(overlay):
    for container in _containers(overlay):
        for variable in container.get("env", []):
            if SECRET_NAME.search(variable["name"]):
                assert "value" not in variable and "secretKeyRef" in variable["valueFrom"], variable["name"]
    assert not any(obj["kind"] == "Secret" for key, obj in overlay.items() if key != "overlay")
    settings = overlay[("ConfigMap", "sage-grpo-settings")]["data"]
    assert not [key for key in settings if SECRET_NAME.search(key)]


def test_training_job_resumes_and_restarts_on_a_checkpointed_stop(overlay):
    job = overlay[("PyTorchJob", "sage-grpo-lora")]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == ({"Master"} if overlay["overlay"] == "dev" else {"Master", "Worker"})
    containers = [replica["template"]["spec"]["containers"][0] for replica in replicas.values()]
    assert all(container == containers[0] for container in containers)  # master and workers run the same thing
    container = containers[0]
    assert container["name"] == "pytorch"
    assert container["command"] == ["python", "-m", "pipeline.launch"]
    args = container["args"]
    assert args[args.index("--resume") + 1] == "auto"
    assert "configs/hunyuanvideo15_sage_lora.yaml" in args
    assert any(arg.startswith("--signals-to-handle=") and "SIGUSR1" in arg for arg in args)
    # The training operator restarts an ExitCode replica only for codes >= 128 (IsRetryableExitCode).
    retry = int(next(arg for arg in args if arg.startswith("--retry-exit-code=")).split("=")[1])
    assert retry >= 128
    assert launch.exit_status(RETRYABLE_EXIT_CODE, False, retry) == retry
    assert launch.exit_status(UserError.exit_code, False, retry) < 128  # a user error is not restarted
    for replica in replicas.values():
        assert replica["restartPolicy"] == "ExitCode"
        timeout = int(next(arg for arg in args if arg.startswith("--shutdown-timeout=")).split("=")[1])
        assert replica["template"]["spec"]["terminationGracePeriodSeconds"] > timeout
    if overlay["overlay"] == "prod":
        assert replicas["Worker"]["replicas"] == 7  # 8 nodes x 8 GPUs, the paper's 64


def test_scheduled_job_maps_exit_75_to_a_replacement_pod(overlay):
    cron = overlay[("CronJob", "sage-grpo-scheduled")]["spec"]
    assert cron["concurrencyPolicy"] == "Forbid"
    job = cron["jobTemplate"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    ignored = [rule for rule in rules if rule["action"] == "Ignore" and "onExitCodes" in rule]
    assert ignored and ignored[0]["onExitCodes"]["operator"] == "In"
    assert RETRYABLE_EXIT_CODE in ignored[0]["onExitCodes"]["values"]
    failing = [rule for rule in rules if rule["action"] == "FailJob"]
    assert failing and UserError.exit_code in failing[0]["onExitCodes"]["values"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["command"] == ["/app/infra/scheduled_run.sh"]
    assert (ROOT / "infra" / "scheduled_run.sh").stat().st_mode & 0o111


def test_mlflow_uses_postgres_from_a_secret_and_s3_artifacts(overlay):
    container = overlay[("Deployment", "mlflow")]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["mlflow", "server"]
    assert "--artifacts-destination=$(MLFLOW_ARTIFACTS_DESTINATION)" in container["args"]
    env = {variable["name"]: variable for variable in container["env"]}
    assert "secretKeyRef" in env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]
    settings = overlay[("ConfigMap", "sage-grpo-settings")]["data"]
    assert settings["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    assert ("Service", "mlflow") in overlay
    assert (("StatefulSet", "postgres") in overlay) == (overlay["overlay"] == "dev")


def test_pods_run_as_non_root_under_the_workload_identity(overlay):
    for pod in _pod_specs(overlay):
        assert pod["securityContext"]["runAsNonRoot"] is True
    if overlay["overlay"] == "prod":
        annotations = overlay[("ServiceAccount", "sage-grpo")]["metadata"]["annotations"]
        assert any("role-arn" in key for key in annotations)
