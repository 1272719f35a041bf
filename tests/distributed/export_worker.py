"""Export a tiny HunyuanVideo 1.5 trained under DeepSpeed ZeRO-3, run by torchrun with 1 or 2 processes: first the
whole transformer (full fine-tuning), then a LoRA adapter. Every rank calls the exports (their gathers are
collectives); rank 0 also writes each model's weights as DeepSpeed itself gathers them, for the test to compare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from sage_grpo.core import distributed
from sage_grpo.core.export import export_policy, model_record
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.update import UpdateConfig

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)  # alpha != rank: the export must fold the scale


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distributed.init()
    out, world = Path(args.out), distributed.world_size()
    for kind in ("full", "lora"):
        engine = _trained_engine(lora=kind == "lora")
        export_policy(engine, out / f"{kind}_world{world}", model=model_record("tiny-hunyuan15", kwargs={"seed": 0}))
        reference = _gathered_state(engine.module)
        if distributed.is_main():
            save_file(reference, out / f"{kind}_reference_world{world}.safetensors")


def _trained_engine(lora: bool):
    transformer = tiny_hunyuan15(seed=0).transformer
    if lora:
        add_lora(transformer, LORA)
    else:
        transformer.requires_grad_(True)
    engine = build_engine(transformer, UpdateConfig(learning_rate=1e-3, micro_batch_size=1), accumulation_steps=1)
    _perturb_trainable(engine.module)
    return engine


def _perturb_trainable(module: torch.nn.Module) -> None:
    """Stand-in for training, the same for every world size: rank 0's perturbed values are scattered back."""
    import deepspeed

    params = [p for p in module.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for param in params:
            param.add_(0.2 * torch.randn(param.shape, generator=generator))


def _gathered_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {name: p.detach().clone().contiguous() for name, p in params}


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
