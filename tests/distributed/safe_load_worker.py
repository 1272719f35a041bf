"""Save a real DeepSpeed checkpoint and load it back through core.safe_load, in one process (a world of one).

``save-and-load``: for each ZeRO stage and fine-tuning kind, train a toy module one step, save, load into a fresh
engine with ``load_engine_checkpoint`` and consolidate with zero_to_fp32 under ``data_only_torch_load``; write a JSON
report. ``load``: load a given checkpoint into a fresh engine; a refusal is one line on stderr and exit 2, as the CLI
reports a UserError.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.errors import UserError
from sage_grpo.core.safe_load import data_only_torch_load, load_engine_checkpoint
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.update import UpdateConfig

TAG = "engine"


class Toy(torch.nn.Module):
    """A frozen base and a trainable head: LoRA's shape (frozen parameters in the checkpoint) in two layers."""

    def __init__(self, kind: str, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.base = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 2)
        self.base.requires_grad_(kind == "full")

    def forward(self, x):
        return self.head(torch.tanh(self.base(x))).square().mean()


def engine_for(stage: str, kind: str, seed: int):
    return build_engine(
        Toy(kind, seed),
        UpdateConfig(learning_rate=1e-2, micro_batch_size=1),
        accumulation_steps=1,
        deepspeed_config_name=stage,
    )


def trainable_weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {name: p.detach().clone().float() for name, p in params}


def save_and_load(stage: str, kind: str, out: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    trained = engine_for(stage, kind, seed=0)
    for _ in range(2):
        trained.backward(trained(torch.randn(3, 6)))
        trained.step()
    expected = trainable_weights(trained)
    directory = out / f"{stage}-{kind}"
    trained.save_checkpoint(str(directory), tag=TAG, save_latest=False)

    fresh = engine_for(stage, kind, seed=1)
    differs_before = any(not torch.equal(expected[n], w) for n, w in trainable_weights(fresh).items())
    load_engine_checkpoint(fresh, directory, TAG, load_module_strict=True)
    loaded = trainable_weights(fresh)
    steps_restored = fresh.global_steps == trained.global_steps == 2
    with data_only_torch_load():
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
    # One more identical step on both: equal only if the optimizer partitions (Adam moments) were restored too.
    batch = torch.randn(3, 6)
    for engine in (trained, fresh):
        engine.backward(engine(batch))
        engine.step()
    after_trained, after_fresh = trainable_weights(trained), trainable_weights(fresh)
    return {
        "differs_before": differs_before,
        "next_step_equal": all(torch.equal(after_trained[n], after_fresh[n]) for n in after_trained),
        "loaded_equal": all(torch.equal(expected[n], loaded[n]) for n in expected),
        "consolidated_equal": all(torch.equal(expected[n], consolidated[n].float()) for n in expected),
        "steps_restored": steps_restored,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save-and-load", "load"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", action="append", default=[])
    parser.add_argument("--kind", action="append", default=[])
    args = parser.parse_args()
    distributed.init()
    if args.mode == "load":
        try:
            load_engine_checkpoint(engine_for(args.stage[0], args.kind[0], seed=1), args.out, TAG)
        except UserError as error:
            print(f"sagegrpo: error: {error}", file=sys.stderr)
            return 2
        return 0
    report = {f"{stage}-{kind}": save_and_load(stage, kind, args.out) for stage in args.stage for kind in args.kind}
    (args.out / "report.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(distributed.exit_launched(main()))
