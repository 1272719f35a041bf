"""Model adapters and the registry that builds one from a config name.

Model modules are imported on first use: importing diffusers' video pipelines costs seconds, which the CLI's
``--help`` and the pure-logic tests should not pay.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..components import check_arguments, check_resolvable, check_signature_names, resolve
from .base import PromptEmbeddings, VideoModelAdapter

# name -> "module:factory".
_REGISTRY = {
    "hunyuan15": "sage_grpo.core.models.hunyuan15:HunyuanVideo15Adapter.from_pretrained",
    "wan": "sage_grpo.core.models.wan:WanAdapter.from_pretrained",
    "tiny-hunyuan15": "sage_grpo.core.models.tiny:tiny_hunyuan15",
    "tiny-wan": "sage_grpo.core.models.tiny:tiny_wan",
}


class ModelConfig(BaseModel):
    """The ``model`` section: which model (a name above or ``"package.module:factory"``), its weights and options.
    The factory is imported and ``kwargs`` bound to its signature when the config is validated."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "tiny-hunyuan15"
    pretrained: str | None = None  # local directory or hub id, for the real models
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    guidance_scale: float = Field(1.0, ge=1.0, le=100.0, allow_inf_nan=False)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _resolvable(cls, name: str) -> str:
        return check_resolvable(name, _REGISTRY, "model")

    @field_validator("kwargs")
    @classmethod
    def _bindable(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if not {"name", "guidance_scale", "dtype"} <= set(info.data):  # an earlier key failed: report that one
            return kwargs
        name, pretrained = info.data["name"], info.data.get("pretrained")
        factory = resolve(name, _REGISTRY, "model")
        needs_weights = "path_or_hub_id" in check_signature_names(factory)
        if needs_weights and not pretrained:
            raise ValueError(
                f"model {name!r} loads weights: set model.pretrained (a local diffusers folder or a hub id)"
            )
        if pretrained and not needs_weights:
            raise ValueError(f"model {name!r} builds its own weights: model.pretrained does not apply")
        supplied = {"guidance_scale": info.data["guidance_scale"], "dtype": info.data["dtype"]}
        if needs_weights:
            supplied |= {"path_or_hub_id": pretrained, "device": "cpu"}
        reserved = sorted(set(kwargs) & set(supplied))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the model section itself, not by its kwargs")
        check_arguments(factory, kwargs, f"model {name!r}", supplied=supplied)
        return kwargs


def build_adapter(name: str, **kwargs) -> VideoModelAdapter:
    """The adapter for a registered name, or for a dotted factory path ``"package.module:factory"``.

    ``kwargs`` go to the factory: for ``hunyuan15``/``wan`` the checkpoint path first (``path_or_hub_id=...``),
    then dtype, device, guidance_scale and the adapter's own options.
    """
    factory = resolve(name, _REGISTRY, "model")
    adapter = factory(**kwargs)
    if not isinstance(adapter, VideoModelAdapter):
        raise TypeError(f"{name!r} built a {type(adapter).__name__}, not a VideoModelAdapter")
    return adapter


__all__ = ["ModelConfig", "PromptEmbeddings", "VideoModelAdapter", "build_adapter"]
