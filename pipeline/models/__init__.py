"""Model adapters and the registry that builds one from a config name.

Model modules are imported on first use: importing diffusers' video pipelines costs seconds, which the CLI's
``--help`` and the pure-logic tests should not pay.
"""

from __future__ import annotations

import importlib
from typing import Callable

from ..errors import UserError
from .base import PromptEmbeddings, VideoModelAdapter

# name -> "module:factory", relative to this package.
_REGISTRY = {
    "hunyuan15": ".hunyuan15:HunyuanVideo15Adapter.from_pretrained",
    "wan": ".wan:WanAdapter.from_pretrained",
    "tiny-hunyuan15": ".tiny:tiny_hunyuan15",
    "tiny-wan": ".tiny:tiny_wan",
}


def build_adapter(name: str, **kwargs) -> VideoModelAdapter:
    """The adapter for a registered name, or for a dotted factory path ``"package.module:factory"``.

    ``kwargs`` go to the factory: for ``hunyuan15``/``wan`` the checkpoint path first (``path_or_hub_id=...``),
    then dtype, device, guidance_scale and the adapter's own options.
    """
    factory = _resolve(_REGISTRY.get(name, name))
    adapter = factory(**kwargs)
    if not isinstance(adapter, VideoModelAdapter):
        raise TypeError(f"{name!r} built a {type(adapter).__name__}, not a VideoModelAdapter")
    return adapter


def _resolve(target: str) -> Callable[..., VideoModelAdapter]:
    module_name, sep, attribute_path = target.partition(":")
    if not sep or not attribute_path:
        known = ", ".join(sorted(_REGISTRY))
        raise UserError(f"unknown model {target!r}: expected one of {known} or 'package.module:factory'")
    module = importlib.import_module(module_name, package=__name__)
    factory = module
    for attribute in attribute_path.split("."):
        factory = getattr(factory, attribute)
    return factory


__all__ = ["PromptEmbeddings", "VideoModelAdapter", "build_adapter"]
