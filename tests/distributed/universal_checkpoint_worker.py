"""Save a DeepSpeed checkpoint on one number of ranks and continue it on another through the universal checkpoint.

``save``: train a toy module two steps (every rank the same batch, so the averaged gradient is the same on any number
of ranks), save the tag, take one more step and write the weights it ends at. ``load`` (another world size): convert
the tag with ``convert_to_universal``, load it into a fresh engine with ``load_engine_checkpoint(universal=True)``,
take the same step and report how the weights compare, as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.safe_load import convert_to_universal, data_only_torch_load, load_engine_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from safe_load_worker import TAG, engine_for, trainable_weights  # noqa: E402

UNIVERSAL = "universal"


def step(engine, seed: int) -> None:
    batch = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(batch))
    engine.step()


def save(stage: str, out: Path) -> None:
    engine = engine_for(stage, "full", seed=0)
    for seed in (1, 2):
        step(engine, seed)
    engine.save_checkpoint(str(out / "checkpoint"), tag=TAG, save_latest=False)
    step(engine, seed=3)
    if distributed.is_main():
        torch.save(trainable_weights(engine), out / "continued.pt")


def load(stage: str, out: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = out / "checkpoint"
    if distributed.is_main():
        convert_to_universal(folder / TAG, folder / UNIVERSAL)
    distributed.barrier()
    engine = engine_for(stage, "full", seed=1)
    load_engine_checkpoint(engine, folder, UNIVERSAL, universal=True, load_module_strict=True)
    loaded = trainable_weights(engine)
    with data_only_torch_load():
        saved = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)
    global_steps = engine.global_steps
    step(engine, seed=3)
    after = trainable_weights(engine)
    continued = torch.load(out / "continued.pt", weights_only=True)
    return {
        "loaded_equal": all(torch.equal(saved[name], loaded[name]) for name in loaded),
        "global_steps": global_steps,
        # Equal within float tolerance only if the Adam moments and step count came through the conversion too.
        "max_step_difference": max(float((after[n] - continued[n]).abs().max()) for n in after),
        "moved_by_step": min(float((after[n] - loaded[n]).abs().max()) for n in after),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--stage", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    distributed.init()
    if args.mode == "save":
        save(args.stage, args.out)
    else:
        report = load(args.stage, args.out)
        (args.out / f"report_rank{distributed.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
