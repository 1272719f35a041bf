"""Experiment tracking on MLflow, built so that a tracking-server outage can never stop a training run.

``Tracker`` logs the resolved config as params (flattened to dotted keys, secrets masked), per-iteration metrics and
artifacts. Only rank 0 talks to MLflow; on other ranks every method does nothing.

Outages: every metric is first appended to ``<run_dir>/mlflow-buffer.jsonl`` and the buffer is then sent. When the
server cannot be reached the buffer simply stays (on disk, so it also survives a crash) and later calls send it,
at most every ``retry_interval_s``; one warning says so per outage. Each row names its run (the MLflow run, or before
that is open the training run's identity), so a run sharing the output folder with one whose buffer was left behind
sends only its own rows and leaves the others' for them. MLflow's own HTTP retries are turned down first:
its defaults (7 retries with exponential backoff, 120 s timeout) would block a training step for minutes per call.
A request the server rejects as invalid cannot succeed by retrying: rejected metrics are moved to a side file and
logged as an error; a run the server refuses to open turns tracking off. Either way the training goes on.
Metric names are checked against MLflow's own rule before they are buffered: one bad name (a reward dimension
called ``a//b``) is logged once and dropped, instead of making the server reject every batch it is part of.

What a run records besides the config (what MLflow users look for): the git commit (MLflow's own
``mlflow.source.git.commit`` tag, when the code runs from a git checkout), the versions of the packages that decide
the result, the container image (``SAGEGRPO_IMAGE``), and whatever the recipe passes to :meth:`Tracker.describe`;
MLflow's system metrics (CPU, memory, disk, network, GPU where ``nvidia-ml-py`` is installed) as ``system/*``;
the prompt set as the run's dataset inputs (:meth:`Tracker.log_prompt_set`); images by step and tables.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import requests
from mlflow import MlflowClient
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking.context.registry import resolve_tags
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_GIT_COMMIT, MLFLOW_GIT_DIRTY
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, _validate_metric_name
from pydantic import BaseModel

from sage_grpo.core import distributed
from sage_grpo.core.errors import first_line, is_outage
from sage_grpo.core.files import atomic_write_text
from sage_grpo.core.progress import quiet_library_bars
from sage_grpo.core.secrets import mask_uri, mask_value
from sage_grpo.core.tracking_config import TrackingConfig, check_mlflow_environment

log = logging.getLogger(__name__)

BUFFER_FILE = "mlflow-buffer.jsonl"
_METRIC_FIELDS = ("key", "value", "timestamp", "step")  # a buffered row's metric; the rest says whose it is
MAX_TAG_LENGTH = 5000  # what most stores accept
# Set only where the operator has not: a failed request fails in seconds, and we retry from the buffer instead.
FAIL_FAST_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def fail_fast_http() -> None:
    """MLflow's HTTP client set to fail in seconds (see FAIL_FAST_HTTP), where the operator has not set it; what the
    operator set must parse (one line otherwise)."""
    check_mlflow_environment()
    for name, value in FAIL_FAST_HTTP.items():
        os.environ.setdefault(name, value)


# --- Params: the resolved config, flattened and masked ---------------------------------------------------------


def loggable_params(config: BaseModel | Mapping[str, Any]) -> dict[str, str]:
    """``{"a": {"b": [1, {"api_key": "x"}]}}`` -> ``{"a.b.0": "1", "a.b.1.api_key": "***"}``.

    Lists are flattened by index like mappings, so a secret inside a list of sections is still seen by its key.
    """
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    return {key: mask_value(key, _as_text(value)) for key, value in _flatten(data, prefix="").items()}


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, Mapping) and node:
        children = node.items()
    elif isinstance(node, (list, tuple)) and node:
        children = enumerate(node)
    else:
        return {prefix.rstrip("."): node}
    flat = {}
    for key, child in children:
        flat.update(_flatten(child, f"{prefix}{key}."))
    return flat


def _as_text(value: Any) -> str:
    # JSON spelling (null, true, []) reads like the YAML config the value came from.
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:MAX_PARAM_VAL_LENGTH]


# --- Metric names ----------------------------------------------------------------------------------------------


def metric_name_problem(name: str) -> str | None:
    """Why MLflow would reject ``name`` as a metric key, or None when it accepts it. MLflow's own check (its
    ``_validate_metric_name`` has no public equivalent), so the rule cannot drift from the server's."""
    if len(name) > MAX_ENTITY_KEY_LENGTH:
        return f"longer than {MAX_ENTITY_KEY_LENGTH} characters"
    try:
        _validate_metric_name(name)
    except MlflowException as error:
        return first_line(error)
    return None


# --- Error classes ---------------------------------------------------------------------------------------------


IDENTITY_TAG = "sagegrpo.run_id"  # the training run's identity, the one that owns its checkpoint root
IMAGE_ENV = "SAGEGRPO_IMAGE"  # the container image the job runs in, set by the Dockerfile / manifests
# The packages whose versions decide a result; each is a tag ``version.<package>``.
VERSIONED_PACKAGES = ("sage-grpo", "torch", "deepspeed", "diffusers", "transformers", "peft", "mlflow")


# --- Where the code came from ------------------------------------------------------------------------------------


def environment_tags(source_dir: str | Path | None = None) -> dict[str, str]:
    """Git commit (and whether the checkout has uncommitted changes), package versions and container image.

    ``source_dir`` defaults to this package's directory: the commit of the code that runs, not of the directory the
    job was started from. An installed package (no checkout) or a machine without git has no commit tag."""
    tags = {f"version.{package}": _version(package) for package in VERSIONED_PACKAGES}
    if os.environ.get(IMAGE_ENV):
        tags["container.image"] = os.environ[IMAGE_ENV]
    source_dir = Path(source_dir) if source_dir else Path(__file__).resolve().parent
    commit = _git(source_dir, "rev-parse", "HEAD")
    if commit:
        tags[MLFLOW_GIT_COMMIT] = commit
        changes = _git(source_dir, "status", "--porcelain", "--untracked-files=no")
        tags[MLFLOW_GIT_DIRTY] = "true" if changes else "false"
    return tags


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _git(directory: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git binary, or a hung filesystem
        return None
    return result.stdout.strip() if result.returncode == 0 else None


class Tracker:
    """Recipe: ``tracker.start(resolved_config, run_id=saved_id)`` once; ``log_metrics`` every iteration;
    ``log_artifact`` / ``log_figure`` as needed; ``finish(status)`` at the end. Save ``tracker.run_id`` with each
    checkpoint so a resumed job appends to the same run."""

    def __init__(self, config: TrackingConfig, run_dir: str | Path):
        self.config = config
        self.run_dir = Path(run_dir)
        self.enabled = config.enabled and distributed.is_main()
        quiet_library_bars()  # MLflow's artifact upload and download bars
        self.run_id: str | None = None
        self._resume_id: str | None = None
        self._params: dict[str, str] = {}
        self._params_logged = False
        self._buffer = self.run_dir / BUFFER_FILE
        self._in_outage = False
        self._retry_after = 0.0
        self._bad_names: set[str] = set()
        self._identity: str | None = None
        # Whose buffered rows are whose: runs sharing an output folder share its buffer (see _owns).
        self._owner = uuid.uuid4().hex
        self._foreign_rows_reported = False
        self._tags: dict[str, str] = {}
        self._system_metrics = None
        if self.enabled:
            fail_fast_http()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(self.tracking_uri)

    @property
    def tracking_uri(self) -> str:
        return self.config.resolved_uri(self.run_dir)

    # --- Public API --------------------------------------------------------------------------------------------

    def start(
        self, config: BaseModel | Mapping[str, Any], run_id: str | None = None, identity: str | None = None
    ) -> str | None:
        """Open a new run, or continue ``run_id`` (saved with the checkpoint), and log ``config`` as params.
        ``identity`` (the training run's own id, which owns its checkpoint root) is set as the tag
        ``sagegrpo.run_id``; without ``run_id``, a run carrying the same identity is continued: a job restarted
        before its first checkpoint reattaches to its MLflow run instead of leaving it RUNNING beside a new one.

        Returns the run id, or None while the server is unreachable: the run is then opened by a later call.
        """
        if not self.enabled:
            return None
        self._params = loggable_params(config)
        # MLflow's fluent start_run infers mlflow.user and mlflow.source.name/type (the UI's User and Source); a run
        # created through the client gets them only from the same context providers.
        self._tags = resolve_tags(environment_tags())
        self._resume_id = run_id
        self._identity = identity
        self._owner = identity or self._owner
        self._sync()
        return self.run_id

    def describe(self, tags: Mapping[str, Any], params: Mapping[str, Any]) -> None:
        """Tags (model, sampler...) and derived params (world size, effective batch...) beside the config's. Kept
        and sent with the params when the server is unreachable now; a resumed run keeps the params it started with
        (MLflow params are write-once) and gets the tags again."""
        if not self.enabled:
            return
        self._tags |= {key: str(value) for key, value in tags.items()}
        self._params |= {key: _as_text(value) for key, value in params.items()}
        self._params_logged = False
        self._sync()

    def log_prompt_set(self, prompt_set: Any, source: str, evaluated: tuple[list, str] | None = None) -> None:
        """The prompts as the run's dataset inputs, one per split (MLflow's contexts ``training`` and
        ``evaluation``), each with its digest, row count and schema, and the ingest report's counts as input tags.
        ``prompt_set``: ``stages.ingest.PromptSet`` (``.train``, ``.eval``: prompts with ``.text`` and
        ``.metadata``; ``.report.kept`` and ``.report.counts``). ``evaluated``: the prompts the evaluations score
        and their source, when they are not ``prompt_set.eval`` (a fixed evaluation set, or the first few held out)."""
        if not self.enabled:
            return
        report = prompt_set.report
        counts = {"kept": report.kept, **{f"skipped.{kind}": n for kind, n in report.counts.items()}}
        eval_prompts, eval_source = evaluated or (prompt_set.eval, source)
        try:
            inputs = [
                _dataset_input(prompts, origin, context, counts if origin == source else {})
                for prompts, origin, context in (
                    (prompt_set.train, source, "training"),
                    (eval_prompts, eval_source, "evaluation"),
                )
                if prompts
            ]
        except Exception as error:  # noqa: BLE001 - MLflow's profiling of odd metadata must never stop training
            log.warning("prompt set not logged to MLflow: %s", first_line(error))
            return
        self._upload("prompt set", lambda: self._client.log_inputs(self.run_id, datasets=inputs))

    def log_image(self, image: Any, key: str, step: int) -> None:
        """An image (uint8 array [H, W, 3] or PIL image) in MLflow's image series ``key``, at ``step``: the UI shows
        it with a step slider."""
        if not self.enabled:
            return
        self._upload(
            f"image {key}", lambda: self._client.log_image(self.run_id, image, key=key, step=step, synchronous=True)
        )

    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None:
        """Columns as an MLflow table (JSON artifact, shown in the UI's evaluation view); rows are appended when
        ``artifact_file`` already exists, so one file holds every evaluation."""
        if not self.enabled:
            return
        self._upload(f"table {artifact_file}", lambda: self._client.log_table(self.run_id, dict(data), artifact_file))

    def logged_through(self, key: str) -> int:
        """The highest step at which ``key`` was logged to this run (0 if never, or unknown during an outage): a run
        that re-executes iterations after a resume skips what its MLflow run already holds."""
        return max(self._logged_steps(key), default=0)

    def has_logged(self, key: str, step: int) -> bool:
        """Whether ``key`` was logged at ``step`` in this run (False when unknown, during an outage)."""
        return step in self._logged_steps(key)

    def _logged_steps(self, key: str) -> set[int]:
        if not self.enabled or self.run_id is None:
            return set()
        try:
            return {metric.step for metric in self._client.get_metric_history(self.run_id, key)}
        except (MlflowException, requests.RequestException, OSError) as error:
            log.warning(
                "could not read the MLflow run's history (%s); iterations may be logged twice", first_line(error)
            )
            return set()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.enabled:
            return
        timestamp = int(time.time() * 1000)
        torn = _ends_mid_line(self._buffer)
        with self._buffer.open("a") as buffer:
            if torn:  # a crash mid-write: the next row must not continue its line
                buffer.write("\n")
            for key, value in metrics.items():
                if self._valid_name(key):
                    row = {"key": key, "value": float(value), "step": step, "timestamp": timestamp}
                    row |= {"run_id": self.run_id, "owner": self._owner}
                    buffer.write(json.dumps(row) + "\n")
        self._sync()

    def _valid_name(self, key: str) -> bool:
        if key in self._bad_names:
            return False
        problem = metric_name_problem(key)
        if problem is not None:
            self._bad_names.add(key)
            log.error("metric %r is not logged to MLflow (%s); the other metrics are", key, problem)
        return problem is None

    def client(self) -> MlflowClient:
        """The MLflow client of this run's tracking server (for the model registry)."""
        return self._client

    def set_tag(self, key: str, value: str) -> None:
        if not self.enabled:
            return
        self._upload(f"tag {key}", lambda: self._client.set_tag(self.run_id, key, value))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, under ``artifact_path``. Not retried: the files stay on disk."""
        if not self.enabled:
            return
        path = Path(path)
        upload = self._client.log_artifacts if path.is_dir() else self._client.log_artifact
        self._upload(str(path), lambda: upload(self.run_id, str(path), artifact_path))

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """Upload a matplotlib figure as ``artifact_file`` (e.g. ``plots/reward.png``)."""
        if not self.enabled:
            return
        self._upload(f"figure {artifact_file}", lambda: self._client.log_figure(self.run_id, figure, artifact_file))

    def finish(self, status: str = "FINISHED") -> None:
        """Send what is buffered (ignoring the retry interval) and mark the run FINISHED, FAILED or KILLED."""
        if not self.enabled:
            return
        self._retry_after = 0.0
        self._sync()
        if self._system_metrics is not None:
            self._system_metrics.finish()  # joins its thread and sends what it sampled last
            self._system_metrics = None
        if self.run_id is None or self._in_outage:
            log.warning("MLflow run not closed: the tracking server is unreachable; %s keeps the metrics", self._buffer)
            return
        try:
            self._client.set_terminated(self.run_id, status)
        except (MlflowException, requests.RequestException, OSError) as error:
            log.warning("MLflow run %s not marked %s: %s", self.run_id, status, first_line(error))

    # --- Talking to MLflow -------------------------------------------------------------------------------------

    def _sync(self) -> None:
        """Open the run if it is not open yet and send the buffer; during an outage, leave both for a later call."""
        if time.monotonic() < self._retry_after:
            return
        try:
            self._open_run()
            self._send_buffer()
        except (MlflowException, requests.RequestException, OSError) as error:
            if is_outage(error):
                self._note_outage(error)
            else:
                self._give_up(error)
            return
        if self._in_outage:
            log.warning("MLflow tracking at %s answers again; buffered metrics sent", self._safe_uri)
            self._in_outage = False
        self._revive_system_metrics()

    def _open_run(self) -> None:
        if self.run_id is None:
            resume_id = self._resume_id or self._run_with_identity()
            self.run_id = self._continue_run(resume_id) if resume_id else self._new_run()
            self._start_system_metrics()
        if not self._params_logged:
            self._log_params()
            self._params_logged = True

    def _revive_system_metrics(self) -> None:
        # MLflow's monitor ends its thread for good after one failed request (an outage between two iterations is
        # enough); the server answers now, so a new monitor takes over. MLflow has no public "is it running".
        monitor = self._system_metrics
        if monitor is not None and (monitor._process is None or not monitor._process.is_alive()):
            self._start_system_metrics()

    def _start_system_metrics(self) -> None:
        if not self.config.system_metrics:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # resume_logging: a monitor taking over (after an outage, or in a resumed run) goes on from the run's last
        # system-metrics step instead of logging over step 0 again.
        if self._system_metrics is not None:
            self._system_metrics.finish()
        self._system_metrics = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=self.config.system_metrics_interval_s,
            resume_logging=True,
            tracking_uri=self.tracking_uri,
        )
        self._system_metrics.start()

    def _new_run(self) -> str:
        tags = {IDENTITY_TAG: self._identity} if self._identity else None
        return self._client.create_run(self._experiment_id(), run_name=self.config.run_name, tags=tags).info.run_id

    def _run_with_identity(self) -> str | None:
        if not self._identity:
            return None
        runs = self._client.search_runs(
            [self._experiment_id()], f"tags.`{IDENTITY_TAG}` = '{self._identity}'", max_results=1
        )
        return runs[0].info.run_id if runs else None

    def _continue_run(self, run_id: str) -> str:
        try:
            self._client.get_run(run_id)
        except MlflowException as error:
            if error.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
            log.warning("MLflow run %s does not exist at %s; starting a new run", run_id, self._safe_uri)
            return self._new_run()
        self._client.update_run(run_id, status="RUNNING")
        return run_id

    def _experiment_id(self) -> str:
        name = self.config.experiment_name()
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        # A database store would otherwise put artifacts in ./mlruns of whatever directory the job started in.
        return self._client.create_experiment(name, artifact_location=self.config.artifact_location(self.run_dir))

    def _log_params(self) -> None:
        existing = self._client.get_run(self.run_id).data.params
        changed = sorted(key for key, value in self._params.items() if existing.get(key, value) != value)
        if changed:
            # MLflow params are write-once: a resumed run keeps the values it started with.
            log.warning("config changed since MLflow run %s started; params keep old values: %s", self.run_id, changed)
        new = [Param(key, value) for key, value in self._params.items() if key not in existing]
        tags = [RunTag(key, value[:MAX_TAG_LENGTH]) for key, value in self._tags.items()]
        self._client.log_batch(self.run_id, params=new, tags=tags)

    def _send_buffer(self) -> None:
        """Send this run's buffered rows; another run's (left by a run that shared the output folder during an
        outage) stay in the buffer for that run to send when it resumes."""
        if not self._buffer.exists():
            return
        ours, others = [], []
        for row in _read_rows(self._buffer):
            (ours if self._owns(row) else others).append(row)
        if others and not self._foreign_rows_reported:
            log.warning("%s holds %d metric(s) of another run: left there for it", self._buffer, len(others))
            self._foreign_rows_reported = True
        if not ours:
            return
        try:
            self._client.log_batch(self.run_id, metrics=[Metric(**{k: row[k] for k in _METRIC_FIELDS}) for row in ours])
        except MlflowException as error:
            if is_outage(error):
                raise
            self._set_aside(error, ours)
        if others:
            atomic_write_text(self._buffer, _as_lines(others))
        else:
            self._buffer.unlink()

    def _owns(self, row: dict[str, Any]) -> bool:
        """A row logged once the MLflow run was open names it; one logged before names the training run's identity
        (or, without one, this tracker), which the run opened later belongs to."""
        if row.get("run_id"):
            return row["run_id"] == self.run_id
        return row.get("owner") == self._owner

    def _set_aside(self, error: MlflowException, rows: list[dict[str, Any]]) -> None:
        rejected = self._buffer.with_name(f"mlflow-rejected-{int(time.time())}.jsonl")
        atomic_write_text(rejected, _as_lines(rows))
        log.error("MLflow rejected metrics (%s); they are kept in %s, the run goes on", first_line(error), rejected)

    def _upload(self, what: str, upload: Callable[[], None]) -> None:
        self._sync()
        if self.run_id is None or self._in_outage:
            log.warning("%s not sent to MLflow: the tracking server is unreachable", what)
            return
        try:
            upload()
        except (MlflowException, requests.RequestException, OSError) as error:
            if is_outage(error):
                self._note_outage(error)
            log.warning("%s not sent to MLflow: %s", what, first_line(error))

    def _give_up(self, error: Exception) -> None:
        # Retrying cannot cure a refusal (say, an experiment deleted on the server); the training goes on untracked.
        log.error("MLflow refused the run (%s); tracking is off for the rest of this process", first_line(error))
        self.enabled = False

    def _note_outage(self, error: Exception) -> None:
        self._retry_after = time.monotonic() + self.config.retry_interval_s
        if not self._in_outage:
            log.warning(
                "MLflow tracking at %s is unreachable (%s); metrics are buffered in %s and sent when it answers",
                self._safe_uri,
                first_line(error),
                self._buffer,
            )
        self._in_outage = True

    @property
    def _safe_uri(self) -> str:
        return mask_uri(self.tracking_uri)


def _dataset_input(prompts: list, source: str, context: str, counts: dict[str, int]) -> DatasetInput:
    import mlflow.data
    import pandas as pd

    frame = pd.DataFrame([{"prompt": prompt.text, **prompt.metadata} for prompt in prompts])
    with warnings.catch_warnings():
        # A local path "can be interpreted in multiple ways" (two equivalent local sources): MLflow picks one.
        warnings.simplefilter("ignore", UserWarning)
        dataset = mlflow.data.from_pandas(frame, source=mask_uri(source), name=Path(source).name or source)
    tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)] + [InputTag(key, str(n)) for key, n in counts.items()]
    return DatasetInput(dataset._to_mlflow_entity(), tags=tags)


def _read_rows(buffer: Path) -> list[dict[str, Any]]:
    rows = []
    for line in buffer.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the torn last line of a crash mid-write: that one value is lost
        if isinstance(row, dict) and all(field in row for field in _METRIC_FIELDS):
            rows.append(row)
    return rows


def _ends_mid_line(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            file.seek(-1, os.SEEK_END)
            return file.read(1) != b"\n"
    except OSError:  # absent or empty
        return False


def _as_lines(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)
