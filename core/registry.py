"""The MLflow model registry: exports become model versions, and a promotion gate moves the ``champion`` alias.

Recipe::

    exam = EvalSet(digest, size=32, source="s3://bucket/eval/v3.jsonl")     # what the metrics were scored on
    version = register_export(client, "t2v-policy", export_dir, run_id, metrics, export_key(run_id, step),
                              base_model="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                              eval_set=exam, step=step)                                # alias "challenger"
    decision = promote(client, "t2v-policy", primary_metric="eval/reward", min_improvement=0.01,
                       guarded={"eval/aesthetic": 0.05})                                      # maybe "champion"
    policy = load_registered_policy("models:/t2v-policy@champion")
    videos = policy.predict(["a red fox runs through snow"], params={"seed": 0})              # uint8 [B, F, H, W, 3]

Aliases, never the deprecated stages. Each version is registered from an MLflow 3 logged model whose source is the
run: the version carries its ``model_id``, and the logged model lists the eval metrics (re-logged with its id, as
``mlflow.<flavor>.log_model`` does for the run's metrics at its step) with the evaluation set they were scored on.
Each version is an MLflow pyfunc (:class:`VideoPolicyModel`) holding the export
(LoRA adapter or full transformer) and the name of the base model it applies to; ``predict`` generates videos on
that base model, built again as the export's ``export.json`` records it (HunyuanVideo 1.5, Wan, a tiny model or a
dotted factory; exports without the record are HunyuanVideo 1.5).
Self-contained for ``mlflow models serve``, and logged from files, never a pickle: the pyfunc is built by MLflow's
models-from-code file ``core/policy_model.py``, the ``core`` package (all the pyfunc imports) is logged with it as
its ``code_paths``, and its pip requirements are the libraries the pyfunc imports (``_SERVING_PACKAGES``, not the
training stack: no DeepSpeed, boto3 or plotting) pinned to the versions that registered it, so the environment MLflow
builds for serving runs the same code on the same libraries.

Integrity: every file of the logged model is listed with its sha256 in ``sha256sums.json``, whose own digest is a tag
of the model version. The registry database, not the artifact store, is the trust anchor: someone who can write to
the bucket can rewrite the files and their list, but not the tag. :func:`load_registered_policy` checks all of it
before MLflow loads anything.

Idempotence: a version is created with all its tags in one call, ``export_key`` among them, and
:func:`register_export` looks for that key before creating, so a rerun after a crash at any point finds the version
instead of creating a second one, then sets what is missing. :func:`promote` sets the same alias and tag again when
rerun.

Fairness: the gate compares a challenger with the champion only when both were scored on the same evaluation set
(its digest, tag ``eval_set.digest``) of at least ``min_eval_prompts`` prompts, and by the same evaluation definition
(tag ``eval_set.definition``: the digest of the rewards, their weights and kwargs, the extra metrics, the judges, the
prompt set, the seed and the sampler's steps, shift and CFG scale, ``stages.evaluate.eval_definition``); otherwise
the challenger is rejected, the decision says why in one line, and it is marked not comparable (``promote`` then exits
2). The decision tag names the set's digest and size. Judges' metrics (``eval/judge/<dimension>``) are recorded like
the rewards', so the primary metric or a guard can be a judge.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import requests
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelOutput, LoggedModelStatus, Metric
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.pyfunc import PythonModel
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

import sage_grpo
from sage_grpo.core.errors import RetryableStop, UserError, first_line, is_outage
from sage_grpo.core.export import LORA_WEIGHT_NAME, read_export_manifest
from sage_grpo.core.files import file_sha256
from sage_grpo.core.progress import quiet_library_bars
from sage_grpo.core.registry_config import DEFAULT_MARGIN, DEFAULT_MIN_EVAL_PROMPTS, DEFAULT_PRIMARY_METRIC
from sage_grpo.core.secrets import MASK, mask_uri
from sage_grpo.core.storage import load_tensors

CHALLENGER = "challenger"
CHAMPION = "champion"
EXPORT_KEY_TAG = "export_key"
ARTIFACTS_SHA256_TAG = "artifacts_sha256"
BASE_MODEL_TAG = "base_model"
DECISION_TAG = "promotion_decision"
METRIC_TAG_PREFIX = "metric."
EVAL_SET_DIGEST_TAG = "eval_set.digest"
EVAL_SET_SIZE_TAG = "eval_set.size"
EVAL_SET_SOURCE_TAG = "eval_set.source"
EVAL_DEFINITION_TAG = "eval_set.definition"
EVAL_DEFINITION_SUMMARY_TAG = "eval_set.definition_summary"
MODEL_MANIFEST = "sha256sums.json"
TINY_BASE_MODEL = "tiny-hunyuan15"


@dataclass(frozen=True)
class EvalSet:
    """The prompts a version's metrics were scored on: ``digest`` identifies them (text, metadata, order), so two
    versions with the same digest took the same exam."""

    digest: str
    size: int
    source: str
    # How it was scored: the evaluation definition's digest ("" when not recorded) and a short readable account.
    definition: str = ""
    definition_summary: str = ""

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> EvalSet | None:
        if EVAL_SET_DIGEST_TAG not in tags:
            return None
        size = tags.get(EVAL_SET_SIZE_TAG, "")
        if not size.isdecimal():  # tags are anyone's to edit: a size that is not a count is no exam to trust
            raise UserError(f"tag {EVAL_SET_SIZE_TAG}={size[:40]!r} is not a number of prompts")
        return cls(
            tags[EVAL_SET_DIGEST_TAG],
            int(size),
            tags.get(EVAL_SET_SOURCE_TAG, ""),
            tags.get(EVAL_DEFINITION_TAG, ""),
            tags.get(EVAL_DEFINITION_SUMMARY_TAG, ""),
        )

    def tags(self) -> dict[str, str]:
        tags = {EVAL_SET_DIGEST_TAG: self.digest, EVAL_SET_SIZE_TAG: str(self.size), EVAL_SET_SOURCE_TAG: self.source}
        if self.definition:  # tag values are capped (5000 characters on most stores): the summary is cut
            tags |= {EVAL_DEFINITION_TAG: self.definition, EVAL_DEFINITION_SUMMARY_TAG: self.definition_summary[:1000]}
        return tags

    def definition_described(self) -> str:
        if not self.definition:
            return "no recorded evaluation definition"
        return f"definition {self.definition[:12]} ({self.definition_summary or 'no summary'})"

    def described(self) -> str:
        return f"evaluation set sha256:{self.digest} ({self.size} prompts)"


# Registration
# ----------------------------------------------------------------------------------------------------------------


def export_key(run_id: str, step: int) -> str:
    """Names one export: the same run and checkpoint step always give the same key."""
    return hashlib.sha256(f"{run_id}:{step}".encode()).hexdigest()[:32]


@contextmanager
def outage_is_retryable(tracking_uri: str | None, doing: str, advice: str | None = None) -> Iterator[None]:
    """The tracking server unreachable while ``doing`` is a RetryableStop (exit 75) saying why in a few whole words
    and, when given, ``advice`` for what to do next: registration is keyed by its export, so the restart that does it
    again registers one version."""
    try:
        yield
    except (MlflowException, requests.RequestException, OSError) as error:
        if not is_outage(error):
            raise
        where = mask_uri(tracking_uri or "")
        raise RetryableStop(f"tracking server {where} unreachable while {doing}: {_cause(error)}", advice) from None


def _cause(error: BaseException) -> str:
    """The innermost error's words ("Connection refused"), not MLflow's and urllib3's wrappers quoting it (whose
    first line runs past 300 characters and used to be cut mid-word); shortened at a word, marked, when long."""
    seen = set()
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(error))
        error = inner
    words = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error)
    return textwrap.shorten(str(words), width=200, placeholder=" ...")


def register_export(
    client: MlflowClient,
    model_name: str,
    export_dir: str | Path,
    run_id: str,
    metrics: dict[str, float],
    export_key: str,
    *,
    base_model: str,
    eval_set: EvalSet | None = None,
    step: int = 0,
) -> ModelVersion:
    """Register a verified export (see :mod:`core.export`) as a version of ``model_name`` tagged with its eval
    metrics and the ``eval_set`` they were scored on (the gate refuses a version without one), through a logged model
    of the run linked to those metrics at ``step``; point the ``challenger`` alias at it. Rerunning with the same
    ``export_key`` creates nothing new."""
    kind = read_export_manifest(export_dir)["kind"]  # refuses an incomplete or corrupted export
    # Tagged and saved with the version for anyone who can read the registry: a URL's user-info stays behind.
    base_model = mask_uri(base_model)
    eval_set = eval_set and replace(eval_set, source=mask_uri(eval_set.source))
    _ensure_registered_model(client, model_name)
    version = _version_with_export_key(client, model_name, export_key)
    if version is None:
        model = _logged_model(client, run_id, export_key, step)
        artifacts_sha256 = _log_policy(client, model, run_id, export_dir, kind, base_model)
        if not model.metrics:  # a rerun after a crash past this point must not log them twice
            _log_model_metrics(client, model.model_id, run_id, metrics, step, eval_set)
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        tags = {
            EXPORT_KEY_TAG: export_key,
            ARTIFACTS_SHA256_TAG: artifacts_sha256,
            BASE_MODEL_TAG: base_model,
            **_metric_tags(metrics),
            **(eval_set.tags() if eval_set else {}),
        }
        # All tags in the creating call: a version never exists without its key, digest and metrics. The source is
        # the logged model's storage, not models:/<id>: a local (sqlite) registry resolves models:/ through the
        # process's global tracking URI, not this client's, and fails to find the model.
        version = client.create_model_version(
            model_name, model.artifact_location, run_id=run_id, tags=tags, model_id=model.model_id
        )
    client.set_registered_model_alias(model_name, CHALLENGER, version.version)
    return client.get_model_version(model_name, version.version)


def _ensure_registered_model(client: MlflowClient, model_name: str) -> None:
    try:
        client.create_registered_model(model_name)
    except MlflowException as error:
        if error.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def _version_with_export_key(client: MlflowClient, model_name: str, key: str) -> ModelVersion | None:
    found = client.search_model_versions(f"name = {_quoted(model_name)} and tags.{EXPORT_KEY_TAG} = {_quoted(key)}")
    return min(found, key=lambda version: int(version.version)) if found else None


def _quoted(text: str) -> str:
    if "'" in text:
        raise UserError(f"{text!r}: names with a single quote cannot be searched in the MLflow registry")
    return f"'{text}'"


def _metric_tags(metrics: dict[str, float]) -> dict[str, str]:
    return {f"{METRIC_TAG_PREFIX}{name}": repr(float(value)) for name, value in metrics.items()}


def _logged_model(client: MlflowClient, run_id: str, key: str, step: int) -> LoggedModel:
    """The run's logged model for this export: the one a crashed earlier attempt created (found by its key, so its
    artifacts are overwritten rather than orphaned), else a new one with the run's params, as ``log_model`` makes."""
    run = client.get_run(run_id)
    experiment_id = run.info.experiment_id
    found = client.search_logged_models([experiment_id], filter_string=f"tags.{EXPORT_KEY_TAG} = {_quoted(key)}")
    if found:
        return found[0]
    model = client.create_logged_model(
        experiment_id,
        name=f"policy-{key[:12]}",
        source_run_id=run_id,
        tags={EXPORT_KEY_TAG: key},
        params=run.data.params,
    )
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
    return model


def _log_model_metrics(
    client: MlflowClient,
    model_id: str,
    run_id: str,
    metrics: dict[str, float],
    step: int,
    eval_set: EvalSet | None,
) -> None:
    """The eval metrics again, now with the model's id (what links them to it) and the evaluation set's name and
    digest (MLflow's per-dataset metric view). A metric the run already has at ``step`` keeps its timestamp, as
    ``log_model`` does: the store then links it to the model without a second point in the run's history (with a
    new timestamp every final evaluation metric showed twice at its step)."""
    dataset = {"dataset_name": Path(eval_set.source).name, "dataset_digest": eval_set.digest} if eval_set else {}
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric(
                name,
                float(value),
                _logged_at(client, run_id, name, float(value), step) or now,
                step,
                model_id=model_id,
                run_id=run_id,
                **dataset,
            )
            for name, value in metrics.items()
        ],
    )


def _logged_at(client: MlflowClient, run_id: str, name: str, value: float, step: int) -> int | None:
    """The timestamp of the run's point ``name`` = ``value`` at ``step``, or None when it has none."""
    history = client.get_metric_history(run_id, name)
    return next((m.timestamp for m in history if m.step == step and m.value == value and m.model_id is None), None)


def _log_policy(
    client: MlflowClient, model: LoggedModel, run_id: str, export_dir: str | Path, kind: str, base_model: str
) -> str:
    """Save the pyfunc locally (its MLmodel naming the logged model and the run), list its files' sha256, upload
    it as the logged model's artifacts; the list's digest."""
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "model"
        mlflow.pyfunc.save_model(
            model_dir,
            mlflow_model=Model(
                artifact_path=model.artifact_location, run_id=run_id, model_uuid=model.model_id, model_id=model.model_id
            ),
            python_model=str(_CODE_PACKAGE / "policy_model.py"),
            artifacts={"export": str(export_dir)},
            model_config={"base_model": base_model, "kind": kind},
            signature=_SIGNATURE,
            code_paths=[str(_code_copy(Path(scratch) / "code"))],
            # Explicit: inferring them would import and run the model in a subprocess.
            pip_requirements=serving_requirements(),
        )
        artifacts_sha256 = _write_model_manifest(model_dir)
        client.log_model_artifacts(model.model_id, str(model_dir))
    return artifacts_sha256


# The foundation floor holds everything the pyfunc imports (core never imports stages or pipeline).
_CODE_PACKAGE = Path(__file__).resolve().parent
# The distributions the pyfunc imports (core.registry, core.export, core.models and what they import); MLflow adds
# itself. Training's own (deepspeed, boto3, matplotlib, imageio, psutil) stay out of a serving environment.
_SERVING_PACKAGES = (
    "torch",
    "diffusers",
    "transformers",
    "tokenizers",
    "peft",
    "accelerate",
    "safetensors",
    "huggingface_hub",
    "pydantic",
    "numpy",
    "pandas",
    "requests",
    "pyyaml",
)


def _code_copy(destination: Path) -> Path:
    """``sage_grpo`` holding ``core`` alone, without bytecode caches (interpreter-specific, and they would change the
    sha256 list per machine)."""
    package = destination / "sage_grpo"
    shutil.copytree(_CODE_PACKAGE, package / "core", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(sage_grpo.__file__, package / "__init__.py")
    return package


def serving_requirements() -> list[str]:
    """The pyfunc's libraries, each pinned to the version running now. A local version label is dropped
    (``torch==2.13.0``, not ``2.13.0+cpu``): the serving machine installs its own build."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in _SERVING_PACKAGES]


def _write_model_manifest(model_dir: Path) -> str:
    sums = {
        path.relative_to(model_dir).as_posix(): file_sha256(path)
        for path in sorted(model_dir.rglob("*"))
        if path.is_file()
    }
    manifest = model_dir / MODEL_MANIFEST
    manifest.write_text(json.dumps(sums, indent=2, sort_keys=True) + "\n")
    return file_sha256(manifest)


# Loading
# ----------------------------------------------------------------------------------------------------------------


# MLflow passes ``params`` to predict only when the signature declares them; sizes are the base model's defaults.
_SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string")]),  # unnamed: a plain list of prompts is a valid input
    params=ParamSchema([ParamSpec("num_inference_steps", "integer", 50), ParamSpec("seed", "integer", 0)]),
)


class VideoPolicyModel(PythonModel):
    """The trained policy as an MLflow pyfunc: ``predict(prompts, params)`` returns videos as uint8
    ``[batch, frames, height, width, 3]``.

    ``prompts``: a list of strings (or a one-column DataFrame of them). ``params``: ``num_inference_steps``
    (50) and ``seed`` (0). Height, width and frame count are the base model's defaults (32x32x5 for the tiny one).
    """

    def load_context(self, context) -> None:
        from sage_grpo.core.models import build_adapter

        export_dir = Path(context.artifacts["export"])
        manifest = read_export_manifest(export_dir)  # a corrupted weight file fails here, not as garbage videos
        model = manifest.get("model") or _legacy_model_record(context.model_config["base_model"])
        # A credential is recorded masked (core.export.model_record): left out, the factory falls back to its own
        # default, for a hub token the serving environment's.
        kwargs = {key: value for key, value in model["kwargs"].items() if value != MASK}
        if model["pretrained"] is not None:
            # The registered base model, not the path training read it from (registry.base_model may name a hub
            # id where training used a local copy).
            kwargs |= {
                "path_or_hub_id": context.model_config["base_model"],
                "device": "cuda" if torch.cuda.is_available() else "cpu",
            }
        self.adapter = build_adapter(model["name"], **kwargs)
        _apply_export(self.adapter.transformer, export_dir, context.model_config["kind"])

    # DataFrame: what MLflow makes of any input under _SIGNATURE. The hint also keeps MLflow from inferring a
    # signature of its own, which would drop the params.
    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> np.ndarray:
        params = params or {}
        adapter = self.adapter
        result = adapter.pipeline(
            prompt=[str(text) for text in model_input.iloc[:, 0]],
            num_inference_steps=int(params.get("num_inference_steps", 50)),
            height=adapter.height,
            width=adapter.width,
            num_frames=adapter.num_frames,
            generator=torch.Generator(adapter.device).manual_seed(int(params.get("seed", 0))),
            output_type="np",
        )
        return (result.frames * 255).round().clip(0, 255).astype("uint8")


def _legacy_model_record(base_model: str) -> dict[str, Any]:
    """Exports written before ``export.json`` named the model family: HunyuanVideo 1.5 was the only one."""
    if base_model == TINY_BASE_MODEL:
        return {"name": TINY_BASE_MODEL, "pretrained": None, "kwargs": {}}
    return {"name": "hunyuan15", "pretrained": base_model, "kwargs": {}}


def _apply_export(transformer, export_dir: Path, kind: str) -> None:
    if hasattr(transformer, "export_components"):  # two-expert Wan 2.2: one subfolder per trained expert
        for folder in sorted(path for path in export_dir.iterdir() if path.is_dir()):
            _apply_export(transformer.component(folder.name), folder, kind)
        return
    if kind == "lora":
        transformer.load_lora_adapter(export_dir, weight_name=LORA_WEIGHT_NAME)
        return
    weights = {}
    for shard in sorted(export_dir.glob("diffusion_pytorch_model*.safetensors")):
        weights |= load_tensors(shard)
    # strict: a key mismatch must fail loudly, never leave base weights in place.
    transformer.load_state_dict(weights, strict=True)


def load_registered_policy(model_uri: str, *, tracking_uri: str | None = None):
    """Download ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``, verify every file against the sha256 list the
    version's tag vouches for, and load it as a pyfunc. :class:`TamperedArtifactError` if anything differs."""
    quiet_library_bars()  # MLflow's download bar
    client = MlflowClient(tracking_uri=tracking_uri)
    version = _version_from_uri(client, model_uri)
    download_uri = client.get_model_version_download_uri(version.name, version.version)
    with tempfile.TemporaryDirectory(prefix="policy-") as scratch:
        # Load the very files that were verified: a second download could fetch different ones.
        model_dir = Path(
            mlflow.artifacts.download_artifacts(download_uri, dst_path=scratch, tracking_uri=client.tracking_uri)
        )
        _verify_model_dir(model_dir, version)
        return mlflow.pyfunc.load_model(str(model_dir))  # weights are in memory once load_context has run


class TamperedArtifactError(UserError):
    """A registered model's files differ from the sha256 list recorded when it was registered."""


def _verify_model_dir(model_dir: Path, version: ModelVersion) -> None:
    where = f"model {version.name} version {version.version}"
    manifest = model_dir / MODEL_MANIFEST
    expected = version.tags.get(ARTIFACTS_SHA256_TAG)
    if expected is None or not manifest.is_file() or file_sha256(manifest) != expected:
        raise TamperedArtifactError(f"{where}: {MODEL_MANIFEST} is missing or not the one registered")
    sums = json.loads(manifest.read_text())
    present = {path.relative_to(model_dir).as_posix() for path in model_dir.rglob("*") if path.is_file()}
    unexpected = sorted(present - set(sums) - {MODEL_MANIFEST})
    changed = sorted(
        name for name, digest in sums.items() if name not in present or file_sha256(model_dir / name) != digest
    )
    if unexpected or changed:
        raise TamperedArtifactError(f"{where}: files changed since registration: {changed + unexpected}")


def _version_from_uri(client: MlflowClient, model_uri: str) -> ModelVersion:
    if not model_uri.startswith("models:/"):
        raise UserError(f"{model_uri!r} is not a registry URI (models:/NAME@ALIAS or models:/NAME/VERSION)")
    reference = model_uri.removeprefix("models:/")
    if "@" in reference:
        name, alias = reference.split("@", 1)
        version = _aliased_version(client, name, alias)
        if version is None:
            raise UserError(f"model {name!r} has no version with alias {alias!r}")
        return version
    name, _, number = reference.rpartition("/")
    return _registry_lookup(lambda: client.get_model_version(name, number), f"{name!r} version {number}")


def _aliased_version(client: MlflowClient, model_name: str, alias: str) -> ModelVersion | None:
    # Through the model's alias map: a missing alias is an ordinary answer here, not an error code to interpret.
    model = _registry_lookup(lambda: client.get_registered_model(model_name), f"model {model_name!r}")
    number = model.aliases.get(alias)
    if number is None:
        return None
    # An alias can outlive its version (deleted through another client or the database): name it, one line.
    return _registry_lookup(
        lambda: client.get_model_version(model_name, number), f"version {number} of {model_name!r}, aliased {alias},"
    )


def _registry_lookup(lookup, what: str):
    try:
        return lookup()
    except MlflowException as error:
        if error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise UserError(f"{what} does not exist in the MLflow model registry") from None
        raise


# Promotion
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromotionDecision:
    model_name: str
    version: str
    champion: str | None  # the champion the candidate was compared with; None when there was none
    promoted: bool
    reasons: list[str] = field(default_factory=list)
    dry_run: bool = False
    eval_set: EvalSet | None = None  # the candidate's
    comparable: bool = True  # False: its scores could not be judged against the champion's (see the reasons)

    def summary(self) -> str:
        verb = (
            ("would promote" if self.dry_run else "promoted")
            if self.promoted
            else ("would not promote" if self.dry_run else "did not promote")
        )
        champion = f"champion v{self.champion}" if self.champion else "no champion"
        return f"{verb} {self.model_name} v{self.version} ({champion}): {self.explained()}"

    def explained(self) -> str:
        """The reasons, and the evaluation set they rest on."""
        exam = f" [{self.eval_set.described()}]" if self.eval_set else ""
        return "; ".join(self.reasons) + exam


def promote(
    client: MlflowClient,
    model_name: str,
    *,
    version: str | int | None = None,
    primary_metric: str = DEFAULT_PRIMARY_METRIC,
    min_improvement: float = DEFAULT_MARGIN,
    guarded: dict[str, float] | None = None,
    min_eval_prompts: int = DEFAULT_MIN_EVAL_PROMPTS,
    dry_run: bool = False,
) -> PromotionDecision:
    """Move ``champion`` to ``version`` (default: the challenger) when its ``primary_metric`` beats the champion's
    by more than ``min_improvement`` and no ``guarded`` metric drops by more than its tolerance (higher is better
    for all metrics; a guard the champion has no value for is not checked). Both must have been scored on the same
    evaluation set of at least ``min_eval_prompts`` prompts, or the candidate is rejected. The decision, with the
    set's digest and size, is recorded as the version's ``promotion_decision`` tag unless ``dry_run``; rerunning it
    records the same."""
    candidate = _candidate(client, model_name, version)
    champion = _aliased_version(client, model_name, CHAMPION)
    exam = EvalSet.from_tags(candidate.tags)
    if champion is not None and champion.version == candidate.version:
        return PromotionDecision(
            model_name, candidate.version, champion.version, True, ["already the champion"], dry_run, exam
        )
    mismatch = _comparison_problem(exam, champion)
    problem = mismatch or _exam_problem(exam, min_eval_prompts)
    promoted, reasons = (
        (False, [problem])
        if problem
        else _judge(
            _metrics(candidate),
            _metrics(champion) if champion else None,
            primary_metric,
            min_improvement,
            guarded or {},
        )
    )
    decision = PromotionDecision(
        model_name,
        candidate.version,
        champion.version if champion else None,
        promoted,
        reasons,
        dry_run,
        exam,
        comparable=mismatch is None,
    )
    if not dry_run:
        _record(client, decision)
    return decision


def _candidate(client: MlflowClient, model_name: str, version: str | int | None) -> ModelVersion:
    if version is not None:
        if not str(version).isdigit():
            raise UserError(f"model version {version!r} is not a version number")
        return _registry_lookup(
            lambda: client.get_model_version(model_name, str(version)), f"{model_name!r} version {version}"
        )
    challenger = _aliased_version(client, model_name, CHALLENGER)
    if challenger is None:
        raise UserError(f"model {model_name!r} has no {CHALLENGER}: pass --version")
    return challenger


def _comparison_problem(exam: EvalSet | None, champion: ModelVersion | None) -> str | None:
    """Why the candidate's scores and the champion's say nothing about each other, if they do not: no recorded
    evaluation set, another set than the champion's, or another evaluation definition (either side unrecorded
    included). A first champion has nothing to be compared with."""
    if exam is None:
        return "this version records no evaluation set (eval_set.* tags): its metrics cannot be compared"
    if champion is None:
        return None
    theirs = EvalSet.from_tags(champion.tags)
    if theirs is None or theirs.digest != exam.digest:
        scored_on = theirs.described() if theirs else "no recorded evaluation set"
        return (
            f"champion v{champion.version} was scored on {scored_on}, this version on another: not comparable "
            f"(score both on one fixed set, eval.source, or move the {CHAMPION} alias by hand)"
        )
    if not theirs.definition or theirs.definition != exam.definition:
        return (
            f"champion v{champion.version} was evaluated by {theirs.definition_described()}, this version by "
            f"{exam.definition_described()}: different evaluation definitions, not comparable (evaluate both with "
            f"the same rewards, weights, kwargs, judges, seed and sampler settings, or move the {CHAMPION} alias by "
            "hand)"
        )
    return None


def _exam_problem(exam: EvalSet, min_eval_prompts: int) -> str | None:
    """Why the candidate's exam is too small to judge by, if it is."""
    if exam.size < min_eval_prompts:
        return f"its evaluation set has {exam.size} prompts, fewer than the minimum {min_eval_prompts}"
    return None


def _metrics(version: ModelVersion) -> dict[str, float]:
    metrics = {}
    for key, value in version.tags.items():
        if key.startswith(METRIC_TAG_PREFIX):
            try:
                metrics[key.removeprefix(METRIC_TAG_PREFIX)] = float(value)
            except ValueError:  # tags are anyone's to edit; the gate must not guess what a non-number means
                raise UserError(
                    f"{version.name!r} version {version.version}: tag {key}={value[:40]!r} is not a number"
                ) from None
    return metrics


def _judge(
    candidate: dict[str, float],
    champion: dict[str, float] | None,
    primary_metric: str,
    min_improvement: float,
    guarded: dict[str, float],
) -> tuple[bool, list[str]]:
    """Whether the candidate may replace the champion, and why (or why not), one reason per check."""
    if primary_metric not in candidate:
        return False, [f"{primary_metric} was not recorded for this version"]
    if not math.isfinite(candidate[primary_metric]):
        # A run whose rewards all failed evaluates to nan; it must never become the first champion either.
        return False, [f"{primary_metric} is {candidate[primary_metric]}: not a number to promote on"]
    if champion is None:
        return True, [f"first champion ({primary_metric} {candidate[primary_metric]:.4g})"]
    if not math.isfinite(champion.get(primary_metric, math.nan)):
        return True, [f"the champion has no finite {primary_metric} to compare with"]
    checks = [_primary_check(candidate, champion, primary_metric, min_improvement)]
    checks += [
        _guard_check(candidate, champion, metric, tolerance)
        for metric, tolerance in sorted(guarded.items())
        if metric in champion
    ]
    return all(passed for passed, _ in checks), [reason for _, reason in checks]


def _primary_check(candidate, champion, metric: str, margin: float) -> tuple[bool, str]:
    gain = candidate[metric] - champion[metric]
    passed = gain > margin
    relation = ">" if passed else "<="
    return passed, (
        f"{metric} {candidate[metric]:.4g} vs {champion[metric]:.4g}: gain {gain:+.4g} {relation} margin {margin:g}"
    )


def _guard_check(candidate, champion, metric: str, tolerance: float) -> tuple[bool, str]:
    if metric not in candidate:
        return False, f"guarded {metric} was not recorded for this version"
    drop = champion[metric] - candidate[metric]
    passed = drop <= tolerance
    relation = "<=" if passed else ">"
    return passed, (
        f"guarded {metric} {candidate[metric]:.4g} vs {champion[metric]:.4g}: drop {drop:.4g} "
        f"{relation} tolerance {tolerance:g}"
    )


def _record(client: MlflowClient, decision: PromotionDecision) -> None:
    outcome = "promoted" if decision.promoted else "rejected"
    # Tag values are capped (5000 characters on most stores); the reasons are short.
    client.set_model_version_tag(
        decision.model_name, decision.version, DECISION_TAG, f"{outcome}: {decision.explained()}"[:5000]
    )
    if decision.promoted:
        client.set_registered_model_alias(decision.model_name, CHAMPION, decision.version)
