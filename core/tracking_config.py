"""The ``tracking`` section of a run config, apart from ``core.tracking`` (which re-exports it) so that reading a
config does not import MLflow: importing it costs a second or more, and pandas with it."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sage_grpo.core.errors import UserError, first_line
from sage_grpo.core.secrets import mask_uri

DEFAULT_EXPERIMENT = "sage-grpo"
# The databases MLflow opens directly through SQLAlchemy (mlflow.store.db.db_types.DATABASE_ENGINES).
_DATABASE_ENGINES = frozenset({"postgresql", "mysql", "sqlite", "mssql"})
# URI schemes MLflow's tracking-store table always holds: a store URI of one of these needs no MLflow to accept.
_BUILT_IN_STORE_SCHEMES = frozenset({"", "file", "http", "https"})


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    # None: MLFLOW_TRACKING_URI, else the embedded store, sqlite:///<run_dir>/mlflow.db with artifacts in
    # <run_dir>/mlflow-artifacts.
    tracking_uri: str | None = None
    experiment: str | None = None  # None: MLFLOW_EXPERIMENT_NAME, else "sage-grpo"
    run_name: str | None = None
    retry_interval_s: float = Field(60.0, ge=0)  # during an outage, how often to try the server again
    # MLflow's system-metrics monitor (system/cpu_utilization_percentage, system/gpu_0_memory_usage_megabytes...)
    system_metrics: bool = True
    system_metrics_interval_s: float = Field(10.0, gt=0)

    # The same order in every command (run, promote, schedule): the config, then MLflow's own environment variables,
    # then the local default, so a job's environment can point it at a server without editing its config.
    def server_uri(self) -> str | None:
        """The tracking server the config or ``MLFLOW_TRACKING_URI`` names; None: the run's embedded store."""
        from mlflow.environment_variables import MLFLOW_TRACKING_URI

        return self.tracking_uri or MLFLOW_TRACKING_URI.get() or None

    def resolved_uri(self, run_dir: str | Path) -> str:
        return self.server_uri() or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"

    def artifact_location(self, run_dir: str | Path) -> str | None:
        """Where a new experiment keeps its artifacts. None where the store decides: a tracking server (its
        ``--artifacts-destination``) or a file store (inside itself). A database opened directly has no artifact
        root, and MLflow's default is ``./mlruns`` of whatever folder the job started in: beside a SQLite file
        (``<its folder>/mlflow-artifacts``, the embedded store's ``<run_dir>/mlflow-artifacts`` included), else in
        ``<run_dir>/mlflow-artifacts``."""
        uri = self.resolved_uri(run_dir)
        engine = uri.split(":", 1)[0].split("+", 1)[0]
        if engine not in _DATABASE_ENGINES:
            return None
        database = uri[len("sqlite:///") :].split("?", 1)[0] if uri.startswith("sqlite:///") else ""
        # sqlite:///x.db is relative to the working folder (as SQLAlchemy opens it), sqlite:////x.db absolute.
        folder = Path(database).resolve().parent if database and database != ":memory:" else Path(run_dir).resolve()
        return (folder / "mlflow-artifacts").as_uri()

    def experiment_name(self) -> str:
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME

        return self.experiment or MLFLOW_EXPERIMENT_NAME.get() or DEFAULT_EXPERIMENT

    @model_validator(mode="after")
    def _mlflow_environment(self):
        if self.enabled:
            check_mlflow_environment()
        return self

    @field_validator("tracking_uri")
    @classmethod
    def _store_mlflow_opens(cls, uri: str | None) -> str | None:
        # MLflow's own scheme table: an ftp:// or s3:// URI would otherwise pass here and end the run in a traceback.
        # Asked only for a scheme beyond the built-in ones (a database, a plugin's), since it imports MLflow.
        if urlparse(uri or "").scheme in _BUILT_IN_STORE_SCHEMES:
            return uri
        from mlflow.exceptions import MlflowException
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        try:
            _tracking_store_registry.get_store_builder(uri or "")
        except MlflowException:
            raise ValueError(
                f"{mask_uri(uri)!r} is not a tracking store MLflow opens (http(s), sqlite, file, ...)"
            ) from None
        return uri


def check_mlflow_environment() -> None:
    """A one-line UserError when an ``MLFLOW_*`` variable MLflow declares holds a value it cannot parse
    (``MLFLOW_HTTP_REQUEST_TIMEOUT=abc``, ``MLFLOW_ENABLE_ASYNC_LOGGING=maybe``): MLflow reads them at its first
    request, deep in a run, and raises a ValueError there. MLflow is imported only when such a variable is set."""
    if not any(name.startswith("MLFLOW_") for name in os.environ):
        return
    from mlflow import environment_variables

    for variable in vars(environment_variables).values():
        name = getattr(variable, "name", None)
        if isinstance(name, str) and name in os.environ and callable(getattr(variable, "get", None)):
            try:
                variable.get()
            except ValueError as error:
                raise UserError(f"MLflow environment: {mask_uri(first_line(error))}") from None
