"""Model adapters and the registry that builds one from a config name.

Model modules are imported on first use: importing diffusers' video pipelines costs seconds, which the CLI's
``--help`` and the pure-logic tests should not pay.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..components import check_arguments, check_resolvable, check_signature_names, resolve
from ..progress import quiet_library_bars
from .base import PromptEmbeddings, VideoModelAdapter

# name -> "module:factory".
_REGISTRY = {
    "hunyuan15": "sage_grpo.core.models.hunyuan15:HunyuanVideo15Adapter.from_pretrained",
    "wan": "sage_grpo.core.models.wan:WanAdapter.from_pretrained",
    "tiny-hunyuan15": "sage_grpo.core.models.tiny:tiny_hunyuan15",
    "tiny-wan": "sage_grpo.core.models.tiny:tiny_wan",
    "tiny-wan22": "sage_grpo.core.models.tiny:tiny_wan22",
}


class ModelConfig(BaseModel):
    """The ``model`` section: which model (a name above or ``"package.module:factory"``), its weights and options.
    The factory is imported and ``kwargs`` bound to its signature when the config is validated."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "tiny-hunyuan15"
    pretrained: str | None = None  # local directory or hub id, for the real models
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    guidance_scale: float = Field(1.0, ge=1.0, le=100.0, allow_inf_nan=False)
    # Two-expert Wan 2.2 (A14B) only: the low-noise expert's CFG scale (None: guidance_scale, as in WanPipeline) and
    # the experts the update trains (None: both; an expert left out stays frozen and its steps are not trained).
    guidance_scale_2: float | None = Field(None, ge=1.0, le=100.0, allow_inf_nan=False)
    train_experts: list[Literal["high", "low"]] | None = Field(None, min_length=1)
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
        supplied |= {key: info.data[key] for key in EXPERT_KEYS if info.data.get(key) is not None}
        if needs_weights:
            supplied |= {"path_or_hub_id": pretrained, "device": "cpu"}
        reserved = sorted(set(kwargs) & set(supplied))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the model section itself, not by its kwargs")
        check_arguments(factory, kwargs, f"model {name!r}", supplied=supplied)
        return kwargs

    @model_validator(mode="after")
    def _experts_accepted(self) -> ModelConfig:
        """The two-expert keys need a factory that takes them, also when no kwargs are given (``_bindable`` then
        does not run)."""
        if self.expert_arguments():
            factory = resolve(self.name, _REGISTRY, "model")
            try:
                inspect.signature(factory).bind_partial(**self.expert_arguments())
            except TypeError:
                key = next(iter(self.expert_arguments()))
                raise ValueError(
                    f"model.{key} applies to two-expert Wan 2.2 (wan, tiny-wan22); model {self.name!r} does not take it"
                ) from None
        return self

    def expert_arguments(self) -> dict[str, Any]:
        """The two-expert keys that are set, as the factory's keyword arguments (a factory without them is refused
        when the config is validated)."""
        return {key: getattr(self, key) for key in EXPERT_KEYS if getattr(self, key) is not None}


EXPERT_KEYS = ("guidance_scale_2", "train_experts")


def sequence_layout(config: ModelConfig) -> tuple[int, int] | None:
    """(attention heads, video tokens of one sample) of the configured model, from configs alone (no weights): what
    ``parallel.sequence_parallel_size`` must divide, checked when the run config loads. None where configs alone
    cannot tell (a model by dotted path, a Wan hub id not on disk, HunyuanVideo 1.5 at its checkpoint's default size):
    the adapter checks the same when it is built (``DiffusersAdapter.enable_sequence_parallel``)."""
    found = _layout_configs(config)
    if found is None:
        return None
    transformer, (spatial, temporal) = found
    factory = resolve(config.name, _REGISTRY, "model")
    defaults = {k: p.default for k, p in inspect.signature(factory).parameters.items()}
    size = {k: config.kwargs.get(k, defaults.get(k)) for k in ("height", "width", "num_frames")}
    if None in size.values():
        return None
    patch = transformer.get("patch_size", 1)
    p_t, p_h, p_w = patch if isinstance(patch, list | tuple) else (transformer.get("patch_size_t", 1), patch, patch)
    frames = (size["num_frames"] - 1) // temporal + 1
    tokens = (frames // p_t) * (size["height"] // spatial // p_h) * (size["width"] // spatial // p_w)
    return transformer["num_attention_heads"], tokens


def _layout_configs(config: ModelConfig) -> tuple[dict, tuple[int, int]] | None:
    """The transformer's config and the VAE's (spatial, temporal) compression of a registered model."""
    from . import tiny

    if config.name == "tiny-hunyuan15":
        vae = tiny.TINY_HUNYUAN15_VAE
        return tiny.TINY_HUNYUAN15_TRANSFORMER | config.kwargs.get("transformer", {}), tuple(vae.values())
    if config.name == "tiny-wan":
        return tiny.TINY_WAN_TRANSFORMER, tuple(tiny.TINY_WAN_VAE.values())
    on_disk = Path(config.pretrained or "")
    transformer, vae = (on_disk / part / "config.json" for part in ("transformer", "vae"))
    if config.name == "hunyuan15":
        # Not on disk: diffusers' defaults, which are the released checkpoints' transformer (16 heads, patch 1). The
        # one config check that imports diffusers (and torch), and only with sequence parallelism on.
        from diffusers import HunyuanVideo15Transformer3DModel

        defaults = inspect.signature(HunyuanVideo15Transformer3DModel).parameters
        found = json.loads(transformer.read_text()) if transformer.is_file() else {}
        found = {k: p.default for k, p in defaults.items()} | found
        vae_config = json.loads(vae.read_text()) if vae.is_file() else {}
        compression = vae_config.get("spatial_compression_ratio", 16), vae_config.get("temporal_compression_ratio", 4)
        return found, compression
    if config.name == "wan" and transformer.is_file() and vae.is_file():
        vae_config = json.loads(vae.read_text())
        compression = vae_config.get("scale_factor_spatial", 8), vae_config.get("scale_factor_temporal", 4)
        return json.loads(transformer.read_text()), compression
    return None


def build_adapter(name: str, **kwargs) -> VideoModelAdapter:
    """The adapter for a registered name, or for a dotted factory path ``"package.module:factory"``.

    ``kwargs`` go to the factory: for ``hunyuan15``/``wan`` the checkpoint path first (``path_or_hub_id=...``),
    then dtype, device, guidance_scale and the adapter's own options.
    """
    factory = resolve(name, _REGISTRY, "model")
    quiet_library_bars()  # before the factory loads weights: diffusers' and transformers' loading bars
    adapter = factory(**kwargs)
    quiet_library_bars(getattr(adapter, "pipeline", None))
    if not isinstance(adapter, VideoModelAdapter):
        raise TypeError(f"{name!r} built a {type(adapter).__name__}, not a VideoModelAdapter")
    return adapter


__all__ = ["ModelConfig", "PromptEmbeddings", "VideoModelAdapter", "build_adapter", "sequence_layout"]
