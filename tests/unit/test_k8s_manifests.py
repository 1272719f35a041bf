"""The Kubernetes manifests (kustomize overlays dev and prod): valid for the API's schemas, pinned images, no inline
secrets, restart policies, the run config mounted from the overlay's ConfigMap, hardened pods, NetworkPolicies."""

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE, UserError
from sage_grpo.core.rewards.server import load_reward_specs
from sage_grpo.core.tracking import IMAGE_ENV
from sage_grpo.pipeline import launch
from sage_grpo.pipeline.config import load_run_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)
SUPPORTED_KUBERNETES = ["1.30.0", "1.34.0"]  # the oldest and newest the manifests are for
RUN_CONFIG = "/etc/sage-grpo"  # where the sage-grpo-run ConfigMap is mounted
# Set in the pod by the training operator, not by the manifests.
OPERATOR_VARIABLES = {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"}


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


def _pod_templates(objects: dict):
    """(object, pod template) pairs: the pod's labels are in the template's metadata."""
    for key, obj in objects.items():
        if key == "overlay":
            continue
        spec = obj.get("spec", {})
        if obj["kind"] == "PyTorchJob":
            yield from ((obj, replica["template"]) for replica in spec["pytorchReplicaSpecs"].values())
        elif obj["kind"] == "CronJob":
            yield obj, spec["jobTemplate"]["spec"]["template"]
        elif "template" in spec:
            yield obj, spec["template"]


def _containers(objects: dict):
    for pod in _pod_specs(objects):
        yield from pod.get("initContainers", []) + pod["containers"]


def _sage_grpo_containers(objects: dict):
    """(pod spec, container) for the containers that run this project's image (not postgres)."""
    for pod in _pod_specs(objects):
        for container in pod["containers"]:
            if "sage-grpo" in container["image"]:
                yield pod, container


def _training_containers(objects: dict):
    cron = objects[("CronJob", "sage-grpo-scheduled")]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    replicas = objects[("PyTorchJob", "sage-grpo-lora")]["spec"]["pytorchReplicaSpecs"].values()
    return [cron["containers"][0]] + [replica["template"]["spec"]["containers"][0] for replica in replicas]


def _dockerfile_uid() -> int:
    return int(re.search(r"useradd --uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES)
def test_rendered_overlay_is_valid_for_the_supported_kubernetes_versions(overlay, version):
    checked = 0
    for key, obj in overlay.items():
        if key == "overlay":
            continue
        if obj["kind"] == "PyTorchJob":  # a custom resource without a schema here: its pods are core pod templates
            for name, replica in obj["spec"]["pytorchReplicaSpecs"].items():
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name.lower()}}
                kubernetes_validate.validate({**template, "template": replica["template"]}, version, strict=True)
                checked += 1
        else:
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked >= 12


def test_images_are_pinned_and_prod_runs_its_image_by_digest(overlay):
    images = [container["image"] for container in _containers(overlay)]
    assert len(images) >= 5
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag not in ("", "latest"), image
    if overlay["overlay"] == "prod":
        for _, container in _sage_grpo_containers(overlay):
            assert re.fullmatch(r"[\w./-]+/sage-grpo@sha256:[0-9a-f]{64}", container["image"]), container["image"]


def test_training_pods_record_the_image_they_run(overlay):
    for container in _training_containers(overlay):
        env = {variable["name"]: variable.get("value") for variable in container["env"]}
        assert env[IMAGE_ENV] == container["image"]


def test_every_pod_and_container_is_hardened(overlay):
    for pod, container in ((spec, container) for spec in _pod_specs(overlay) for container in spec["containers"]):
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        assert security["readOnlyRootFilesystem"] is True
        # With a read-only root, every folder a program writes to is a volume.
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        writable = {mount["mountPath"] for mount in container["volumeMounts"] if not mount.get("readOnly")}
        assert "/tmp" in writable, container["name"]
        for mount in container["volumeMounts"]:
            assert mount["name"] in volumes or mount["name"] in _claim_templates(overlay), mount
    assert overlay[("ServiceAccount", "sage-grpo")]["automountServiceAccountToken"] is False
    for pod, container in _sage_grpo_containers(overlay):
        # The image's user, whose HOME the libraries write their dot-folders to.
        assert pod["securityContext"]["runAsUser"] == _dockerfile_uid() >= 10000
        assert "/home/sage" in {mount["mountPath"] for mount in container["volumeMounts"] if not mount.get("readOnly")}


def _claim_templates(objects: dict) -> set[str]:
    return {
        claim["metadata"]["name"]
        for key, obj in objects.items()
        if key != "overlay"
        for claim in obj.get("spec", {}).get("volumeClaimTemplates", [])
    }


def _strings(node):
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, str):
        yield node


def _expand(text: str, settings: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda match: settings[match.group(1)], text)


def test_run_config_comes_from_the_configmap_with_the_overlays_paths(overlay, tmp_path):
    settings = overlay[("ConfigMap", "sage-grpo-settings")]["data"]
    files = overlay[("ConfigMap", "sage-grpo-run")]["data"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    # No placeholder and nothing of one environment: local paths are on the cache volume, the rest is the overlay's.
    assert "s3://" not in files["run.yaml"]
    assert all(
        path.startswith("/cache/") for path in _strings(yaml.safe_load(files["run.yaml"])) if path.startswith("/")
    )
    assert "tracking_uri" not in files["run.yaml"]  # the overlay's MLFLOW_TRACKING_URI is the server
    assert settings["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"

    for pod, container in _sage_grpo_containers(overlay):
        # Every $(VAR) in a command line is set: by the overlay's settings, or by the training operator.
        for arg in container.get("args", []):
            assert set(re.findall(r"\$\((\w+)\)", arg)) <= set(settings) | OPERATOR_VARIABLES, arg
        read = [arg for arg in container.get("args", []) if arg.startswith(RUN_CONFIG + "/")]
        if not read:
            continue
        mount = next(mount for mount in container["volumeMounts"] if mount["mountPath"] == RUN_CONFIG)
        volume = next(volume for volume in pod["volumes"] if volume["name"] == mount["name"])
        assert volume["configMap"]["name"] == "sage-grpo-run"
        assert {Path(arg).name for arg in read} <= set(files)

    job = overlay[("PyTorchJob", "sage-grpo-lora")]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    args = job["containers"][0]["args"]
    config = args[args.index("run") + 1]
    overrides = [_expand(arg, settings) for arg in args[args.index("run") + 2 :] if "=" in arg]
    run = load_run_config(tmp_path / Path(config).name, overrides)
    assert run.checkpoint.uri.startswith(settings["CHECKPOINT_ROOT"] + "/")
    assert run.data.source == settings["TRAINING_PROMPTS_URI"]
    assert run.run.output_dir.startswith("/cache/")  # the cache volume, writable and kept across restarts
    assert run.rewards[0].name == "remote" and run.rewards[0].kwargs["url"] == "http://reward:8000"

    cron = overlay[("CronJob", "sage-grpo-scheduled")]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    args = [_expand(arg, settings) for arg in cron["containers"][0]["args"]]
    assert f"--prompts={settings['PROMPTS_URI']}" in args
    assert any(arg.startswith(f"--checkpoint-root={settings['CHECKPOINT_ROOT']}/") for arg in args)
    load_run_config(tmp_path / Path(args[0]).name, [f"data.source={settings['PROMPTS_URI']}/2026-01-01.jsonl"])

    reward = overlay[("Deployment", "reward")]["spec"]["template"]["spec"]["containers"][0]
    assert [spec.name for spec in load_reward_specs(str(tmp_path / Path(reward["args"][0]).name))] == ["videoalign"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def test_network_policies_let_only_training_pods_reach_mlflow_and_the_reward_server(overlay):
    policies = [obj for key, obj in overlay.items() if key != "overlay" and obj["kind"] == "NetworkPolicy"]
    pods = [(obj, template["metadata"].get("labels", {})) for obj, template in _pod_templates(overlay)]
    for obj, labels in pods:  # no pod is left open to the whole cluster
        assert any(_selects(policy["spec"]["podSelector"], labels) for policy in policies), obj["metadata"]["name"]
    training = {
        id(obj) for obj in (overlay[("PyTorchJob", "sage-grpo-lora")], overlay[("CronJob", "sage-grpo-scheduled")])
    }
    for server, port in (("mlflow", 5000), ("reward", 8000)):
        labels = overlay[("Deployment", server)]["spec"]["template"]["metadata"]["labels"]
        service = overlay[("Service", server)]["spec"]
        assert _selects({"matchLabels": service["selector"]}, labels) and service["ports"][0]["port"] == port
        guarding = [policy["spec"] for policy in policies if _selects(policy["spec"]["podSelector"], labels)]
        assert guarding and all(spec["policyTypes"] == ["Ingress"] for spec in guarding)
        for spec in guarding:
            for rule in spec["ingress"]:
                assert [entry["port"] for entry in rule["ports"]] == [port]
                admitted = {
                    id(obj)
                    for obj, pod_labels in pods
                    if any(_selects(source["podSelector"], pod_labels) for source in rule["from"])
                }
                assert admitted == training, server


def test_mlflow_requires_a_login_configured_from_a_secret(overlay):
    pod = overlay[("Deployment", "mlflow")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "--app-name=basic-auth" in container["args"]
    env = {variable["name"]: variable for variable in container["env"]}
    config = Path(env["MLFLOW_AUTH_CONFIG_PATH"]["value"])
    mount = next(mount for mount in container["volumeMounts"] if mount["mountPath"] == str(config.parent))
    volume = next(volume for volume in pod["volumes"] if volume["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "sage-grpo-mlflow-auth"


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
    assert container["command"] == ["python", "-m", "sage_grpo.pipeline.launch"]
    args = container["args"]
    assert args[args.index("--resume") + 1] == "auto"
    assert args[args.index("run") + 1] == f"{RUN_CONFIG}/run.yaml"
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
    disrupted = [rule for rule in rules if "onPodConditions" in rule]
    assert disrupted[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
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
