"""The ``tracking`` section of a run config, apart from ``core.tracking`` (which re-exports it) so that reading a
config does not import MLflow: importing it costs a second or more, and pandas with it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sage_grpo.core.secrets import mask_uri

DEFAULT_EXPERIMENT = "sage-grpo"
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

    def experiment_name(self) -> str:
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME

        return self.experiment or MLFLOW_EXPERIMENT_NAME.get() or DEFAULT_EXPERIMENT

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
