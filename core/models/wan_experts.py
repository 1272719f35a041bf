"""Wan 2.2 A14B's two experts as one ``torch.nn.Module`` (``core.models.wan`` builds it): a module of its own because
defining it imports torch, which validating a config must not (``WanAdapter`` imports it on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .wan import EXPERTS, PIPELINE_COMPONENTS, Expert

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's two transformers as one module: ``high`` (the pipeline's ``transformer``) and ``low``
    (``transformer_2``). ``forward(expert=..., **inputs)`` runs the named one; under ZeRO-3 that gathers only its
    parameters, and a backward reaches only its parameters."""

    def __init__(self, high: WanTransformer3DModel, low: WanTransformer3DModel):
        super().__init__()
        self.high, self.low = high, low
        self.num_experts = len(EXPERTS)  # one runs per forward (what core.flops counts)
        # What the engine reads off a diffusers model: the blocks ZeRO-3 gathers whole, the width its buckets follow.
        self._no_split_modules = list(high._no_split_modules or [])
        self.config = high.config

    def forward(self, *, expert: Expert, **inputs):
        return self.expert(expert)(**inputs)

    def expert(self, name: Expert) -> WanTransformer3DModel:
        return getattr(self, name)

    def export_components(self) -> dict[str, str]:
        """The trained experts by their WanPipeline component name -> attribute here (``core.export``): an expert
        that does not train is the base checkpoint's, which the export does not repeat."""
        return {
            PIPELINE_COMPONENTS[name]: name
            for name in EXPERTS
            if any(p.requires_grad for p in self.expert(name).parameters())
        }

    def component(self, name: str) -> WanTransformer3DModel:
        """The expert a WanPipeline component name (``transformer``, ``transformer_2``) names."""
        by_component: dict[str, Expert] = {component: expert for expert, component in PIPELINE_COMPONENTS.items()}
        if name not in by_component:
            raise ValueError(f"{name!r} is not a Wan 2.2 expert's component ({', '.join(by_component)})")
        return self.expert(by_component[name])

    def enable_gradient_checkpointing(self) -> None:
        for name in EXPERTS:
            self.expert(name).enable_gradient_checkpointing()
