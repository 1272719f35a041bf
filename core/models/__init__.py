"""Model adapters and the registry that builds one from a config name.

Model modules are imported on first use: importing diffusers' video pipelines costs seconds, which the CLI's
``--help`` and the pure-logic tests should not pay.
"""

from __future__ import annotations

from ..components import resolve
from .base import PromptEmbeddings, VideoModelAdapter

# name -> "module:factory".
_REGISTRY = {
    "hunyuan15": "core.models.hunyuan15:HunyuanVideo15Adapter.from_pretrained",
    "wan": "core.models.wan:WanAdapter.from_pretrained",
    "tiny-hunyuan15": "core.models.tiny:tiny_hunyuan15",
    "tiny-wan": "core.models.tiny:tiny_wan",
}


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


__all__ = ["PromptEmbeddings", "VideoModelAdapter", "build_adapter"]
