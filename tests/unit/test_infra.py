"""Deployment files keep their promises: the image pins what pyproject allows, every manifest parses and restarts on
a checkpointed stop (exit 75), no secret is inlined, the Slurm script requeues on its pre-timeout signal, and the
scheduled run never trains the same day twice."""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

from core.errors import RETRYABLE_EXIT_CODE, UserError
from pipeline import launch, schedule

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------------------------

def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _instructions() -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    lines = [line for line in _dockerfile().splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(part.strip() for part in chunk.split("\\\n")) for chunk in
            re.split(r"(?<!\\)\n", "\n".join(lines)) if chunk.strip()]


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=\"?([^\"\n]+)\"?$", _dockerfile(), re.MULTILINE)
    assert match, f"Dockerfile has no ARG {name}=..."
    return match.group(1)


def _pyproject_requirement(name: str) -> Requirement:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, dependencies) if r.name == name)


def test_image_pins_torch_and_deepspeed_inside_pyprojects_ranges():
    assert _pyproject_requirement("torch").specifier.contains(_arg("TORCH_VERSION"))
    assert _pyproject_requirement("deepspeed").specifier.contains(_arg("DEEPSPEED_VERSION"))
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url', _dockerfile())


def test_torch_wheels_match_the_base_images_cuda():
    major, minor, _ = _arg("CUDA_VERSION").split(".")
    assert _arg("TORCH_INDEX").endswith(f"/cu{major}{minor}")
    assert "FROM nvidia/cuda:${CUDA_VERSION}-" in _dockerfile()


def test_deepspeed_ops_are_prebuilt_for_ampere_and_hopper():
    build = next(run for run in _instructions() if run.startswith("RUN ") and 'pip install "deepspeed==' in run)
    assert "DS_BUILD_FUSED_ADAM=1" in build and "DS_BUILD_CPU_ADAM=1" in build
    architectures = _arg("TORCH_CUDA_ARCH_LIST").split(";")
    assert {"8.0", "9.0"} <= set(architectures)


def test_image_runs_sagegrpo_as_a_non_root_user():
    lines = _instructions()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    entrypoint = [line for line in lines if line.startswith("ENTRYPOINT ")]
    assert json.loads(entrypoint[-1][len("ENTRYPOINT "):]) == ["sagegrpo"]


def test_image_environment_puts_caches_on_the_volume_and_fails_fast_on_nccl_errors():
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(run for run in _instructions() if run.startswith("ENV "))))
    assert env["HF_HOME"].startswith("/cache/") and env["TORCH_EXTENSIONS_DIR"].startswith("/cache/")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert 'VOLUME ["/cache"]' in _dockerfile()


def test_everything_the_image_copies_exists_and_is_not_dockerignored():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    sources = re.findall(r"^COPY (?!--from)(\S+)", _dockerfile(), re.MULTILINE)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source not in ignored, source


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------------------------

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
    built = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / request.param)],
                           capture_output=True, text=True, check=True).stdout
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


# ---------------------------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------------------------

SBATCH = ROOT / "infra" / "slurm" / "train.sbatch"


def test_sbatch_requests_requeue_and_a_pre_timeout_signal():
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")]
    assert "--requeue" in directives
    assert "--signal=B:USR1@300" in directives
    assert re.search(r"^trap \w+ USR1$", SBATCH.read_text(), re.MULTILINE)


def _fake_slurm(tmp_path: Path, step_status: str) -> dict:
    """srun, scancel and scontrol stand-ins: the "step" exits 75 on SIGUSR1 (as a checkpointing run does)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": f'echo "$@" > {tmp_path}/srun.args\n'
                f'[ "{step_status}" = wait ] || exit {step_status}\n'
                f'trap "exit {RETRYABLE_EXIT_CODE}" USR1\necho $$ > {tmp_path}/step.pid\n'
                "while :; do sleep 0.05; done",
        "scancel": f'echo "$@" >> {tmp_path}/scancel.log\nkill -USR1 "$(cat {tmp_path}/step.pid)"',
        "scontrol": f'if [ "$1" = show ]; then echo node1; else echo "$@" >> {tmp_path}/scontrol.log; fi',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
            "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1"}


def test_sbatch_relays_usr1_and_requeues_on_exit_75(tmp_path):
    env = _fake_slurm(tmp_path, "wait")
    job = subprocess.Popen(["bash", str(SBATCH), "configs/x.yaml", "seed=3"], env=env, cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while not (tmp_path / "step.pid").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does
    assert job.wait(timeout=10) == RETRYABLE_EXIT_CODE, job.communicate()[0]
    assert (tmp_path / "scancel.log").read_text().split() == ["--signal=USR1", "42"]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "42"]
    srun_args = (tmp_path / "srun.args").read_text().split()
    assert srun_args[srun_args.index("--resume") + 1] == "auto"
    assert "--rdzv-endpoint=node1:29500" in srun_args and "seed=3" in srun_args


def test_sbatch_does_not_requeue_a_finished_or_failed_run(tmp_path):
    for status in ("0", "1"):
        work = tmp_path / status
        work.mkdir()
        result = subprocess.run(["bash", str(SBATCH), "configs/x.yaml"], env=_fake_slurm(work, status), cwd=work,
                                capture_output=True, text=True, timeout=10)
        assert result.returncode == int(status)
        assert not (work / "scontrol.log").exists()


# ---------------------------------------------------------------------------------------------------------------
# pipeline.launch: torchrun's outcome as a status schedulers act on (real torchrun runs: tests/distributed)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("root_cause, signalled, expected", [
    (None, False, 0),
    (RETRYABLE_EXIT_CODE, False, 143),
    (None, True, 143),           # stopped from outside: resume from the newest committed checkpoint
    (1, True, 143),
    (UserError.exit_code, False, UserError.exit_code),
    (1, False, 1),
    (-9, False, 1),              # killed (OOM killer): restarting would loop
    (139, False, 1),
])
def test_launch_exit_status(root_cause, signalled, expected):
    assert launch.exit_status(root_cause, signalled, retry_exit_code=143) == expected


# ---------------------------------------------------------------------------------------------------------------
# The scheduled run
# ---------------------------------------------------------------------------------------------------------------

TODAY = date(2026, 12, 3)
PROMPT_SETS = ["2026-11-20", "2026-12-01.jsonl", "_SUCCESS", ".2026-12-09.uploading"]


def _run(name, prompt_set="2026-11-20", completed=()):
    return schedule.RunState(name, prompt_set, frozenset(completed))


def test_first_start_of_the_day_trains_a_new_run_on_the_newest_prompt_set():
    decision = schedule.decide(TODAY, PROMPT_SETS, [_run("sage-2026-12-02", completed=schedule.STEPS)])
    assert decision.action == "new"
    assert decision.run_name == "sage-2026-12-03"
    assert decision.prompt_set == "2026-12-01.jsonl"  # hidden and marker entries are not prompt sets
    assert decision.steps == schedule.STEPS


def test_a_complete_run_today_means_nothing_to_do():
    decision = schedule.decide(TODAY, PROMPT_SETS, [_run("sage-2026-12-03", completed=schedule.STEPS)])
    assert (decision.action, decision.steps) == ("skip", ())


def test_a_prompt_set_already_trained_is_not_trained_again():
    done = _run("sage-2026-12-02", prompt_set="2026-12-01.jsonl", completed=schedule.STEPS)
    decision = schedule.decide(TODAY, PROMPT_SETS, [done])
    assert (decision.action, decision.steps) == ("skip", ())
    assert "already trained by sage-2026-12-02" in decision.reason


def test_an_unfinished_run_is_resumed_from_its_first_unfinished_step_on_its_own_prompts():
    runs = [_run("sage-2026-11-30", completed=schedule.STEPS), _run("sage-2026-12-01", completed={"train"}),
            _run("manual-experiment")]
    decision = schedule.decide(TODAY, PROMPT_SETS, runs)
    assert decision.action == "resume"
    assert decision.run_name == "sage-2026-12-01"
    assert decision.prompt_set == "2026-11-20"
    assert decision.steps == ("promote",)


def test_markers_of_runs_from_before_the_evaluate_step_was_dropped_still_read(tmp_path):
    root = schedule.Store(str(tmp_path))
    old_layout = {"sage-2026-12-01": ("train", "evaluate", "promote"), "sage-2026-12-02": ("train", "evaluate")}
    for name, steps in old_layout.items():
        root.write("2026-12-01\n", name, "schedule", "prompt_set")
        for step in steps:
            root.write("", name, "schedule", f"{step}.done")
    complete, unfinished = schedule.read_runs(root)
    assert complete.done and not unfinished.done
    assert schedule.decide(TODAY, PROMPT_SETS, [complete, unfinished]).steps == ("promote",)


def test_unscheduled_runs_are_ignored_and_missing_prompts_are_a_user_error():
    with pytest.raises(UserError, match="no prompt set"):
        schedule.decide(TODAY, ["_SUCCESS"], [_run("manual-experiment")])
    with pytest.raises(UserError, match="prompt_set"):
        schedule.decide(TODAY, PROMPT_SETS, [_run("sage-2026-12-01", prompt_set=None)])


def _config(tmp_path: Path, tracking_uri: str | None = "http://mlflow.example:5000") -> Path:
    """The demo config on a shared tracking server, as the scheduled run needs."""
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["tracking"] = {"tracking_uri": tracking_uri}
    path = tmp_path / "scheduled.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _args(tmp_path: Path, day: str = "2026-12-03", dry_run: bool = False,
          config: Path | None = None) -> schedule.ScheduleOptions:
    prompts = tmp_path / "prompts"
    for name in ("2026-12-01", "2026-12-02"):
        (prompts / name).mkdir(parents=True, exist_ok=True)
    return schedule.ScheduleOptions(str(config or _config(tmp_path)), str(prompts), str(tmp_path / "ckpt"), "m",
                                    date=date.fromisoformat(day), dry_run=dry_run)


@pytest.fixture
def steps(monkeypatch):
    """Steps become tiny Python commands whose statuses the test chooses; what ran is recorded."""
    ran, statuses = [], {}

    def command(step, decision, args, root):
        ran.append((step, decision.run_name, decision.prompt_set))
        return [sys.executable, "-c", f"raise SystemExit({statuses.get(step, 0)})"]
    monkeypatch.setattr(schedule, "step_command", command)
    return ran, statuses


def test_starting_twice_the_same_day_does_not_train_twice(tmp_path, steps):
    ran, _ = steps
    assert schedule.run_schedule(_args(tmp_path)) == 0
    assert ran == [(step, "sage-2026-12-03", "2026-12-02") for step in schedule.STEPS]
    assert (tmp_path / "ckpt" / "sage-2026-12-03" / "schedule" / "prompt_set").read_text().strip() == "2026-12-02"
    assert schedule.run_schedule(_args(tmp_path)) == 0
    assert len(ran) == len(schedule.STEPS)  # the second start ran nothing


def test_a_checkpointed_stop_is_passed_on_and_resumed_at_the_next_start(tmp_path, steps):
    ran, statuses = steps
    statuses["train"] = RETRYABLE_EXIT_CODE
    assert schedule.run_schedule(_args(tmp_path)) == RETRYABLE_EXIT_CODE
    assert not (tmp_path / "ckpt" / "sage-2026-12-03" / "schedule" / "train.done").exists()
    statuses["train"] = 0
    (tmp_path / "prompts" / "2026-12-04").mkdir()  # new data for the second day
    # The next day's start finishes yesterday's run before starting a new one.
    assert schedule.run_schedule(_args(tmp_path, day="2026-12-04")) == 0
    assert ran[1:] == [(step, "sage-2026-12-03", "2026-12-02") for step in schedule.STEPS]  # its own prompts
    assert schedule.run_schedule(_args(tmp_path, day="2026-12-04")) == 0
    assert ran[-1] == ("promote", "sage-2026-12-04", "2026-12-04")


def test_dry_run_writes_nothing(tmp_path, steps, capsys):
    ran, _ = steps
    assert schedule.run_schedule(_args(tmp_path, dry_run=True)) == 0
    assert not (tmp_path / "ckpt").exists() and len(ran) == len(schedule.STEPS)
    assert "schedule: new: new run sage-2026-12-03" in capsys.readouterr().out


def test_train_step_runs_under_the_launcher_with_resume_auto(tmp_path):
    args = _args(tmp_path)
    decision = schedule.Decision("new", "sage-2026-12-03", "2026-12-02", schedule.STEPS, "")
    command = schedule.step_command("train", decision, args, schedule.Store(args.checkpoint_root))
    assert command[1:3] == ["-m", "pipeline.launch"]
    assert command[command.index("--resume") + 1] == "auto"
    assert f"data.source={tmp_path}/prompts/2026-12-02" in command
    assert f"checkpoint.uri={tmp_path}/ckpt/sage-2026-12-03/checkpoints" in command
    assert "run.output_dir=/cache/runs/sage-2026-12-03" in command
    # The run registers its result as the challenger; the gate is the separate promote step.
    assert {"registry.model_name=m", "registry.promote=false"} <= set(command)


def test_promote_step_gates_with_the_configs_registry_settings(tmp_path):
    args = _args(tmp_path)
    decision = schedule.Decision("new", "sage-2026-12-03", "2026-12-02", schedule.STEPS, "")
    command = schedule.step_command("promote", decision, args, schedule.Store(args.checkpoint_root))
    assert command[:2] == ["sagegrpo", "promote"]
    assert command[command.index("--config") + 1] == args.config
    assert command[command.index("--model") + 1] == "m"
    assert not any(part.startswith("--tracking-uri") for part in command)  # may hold credentials: logged lines


@pytest.mark.parametrize("problem, tracking_uri, message", [
    ("no shared tracking server", None, "needs tracking.tracking_uri"),
    ("an invalid config", "http://mlflow:5000", "update.learning_rate"),
])
def test_a_config_the_scheduled_run_cannot_use_is_refused_before_any_step(tmp_path, steps, problem, tracking_uri,
                                                                           message):
    ran, _ = steps
    config = _config(tmp_path, tracking_uri)
    if problem == "an invalid config":
        config.write_text(config.read_text().replace("learning_rate: 0.003", "learning_rate: -1"))
    with pytest.raises(UserError, match=message):
        schedule.run_schedule(_args(tmp_path, config=config))
    assert ran == [] and not (tmp_path / "ckpt").exists()



def test_scheduled_run_script_exits_quietly_while_another_holds_the_lock(tmp_path):
    lock = tmp_path / "lock"
    env = {**os.environ, "SAGEGRPO_SCHEDULE_LOCK": str(lock), "SAGEGRPO_PYTHON": "/bin/false"}
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = subprocess.run([str(ROOT / "infra" / "scheduled_run.sh"), "--dry-run"], env=env,
                                capture_output=True, text=True, timeout=10)
    assert result.returncode == 0 and "another scheduled run" in result.stdout
    result = subprocess.run([str(ROOT / "infra" / "scheduled_run.sh")], env=env, capture_output=True, timeout=10)
    assert result.returncode == 1  # unlocked: it went on to run $SAGEGRPO_PYTHON (here /bin/false)
