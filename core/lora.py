"""LoRA through peft, on the diffusers ``add_adapter`` path: only adapter weights train, base weights stay frozen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    import torch

ADAPTER_NAME = "default"


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    rank: int = Field(32, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = 0.0
    # The attention projections of both the double- and single-stream blocks: what HunyuanVideo LoRAs usually train.
    target_modules: list[str] = Field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        # The policy runs in eval mode (which is what keeps the on-policy ratio exactly 1): dropout would never act.
        if value != 0:
            raise ValueError(
                "must be 0: the policy runs in eval mode (on-policy ratio == 1), so dropout would be inert"
            )
        return value


def add_lora(transformer: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Freeze the base weights and add a trainable adapter (B initialised to zero, so the policy starts at the base)."""
    from peft import LoraConfig as PeftLoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(
        PeftLoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            lora_dropout=config.dropout,
            target_modules=config.target_modules,
            init_lora_weights=True,
        ),
        adapter_name=ADAPTER_NAME,
    )
    if not any(p.requires_grad for p in transformer.parameters()):
        raise ValueError(f"LoRA target modules {config.target_modules} match no layer of {type(transformer).__name__}")
    return transformer
