"""One evaluation of a tiny HunyuanVideo 1.5 partitioned by DeepSpeed ZeRO-3 (so every forward is a collective), run
by torchrun; rank 0 writes what a single-rank evaluation must equal: metrics, per-prompt scores, key frames, videos.
Then one training rollout, scored while it is generated as a run scores it; every rank writes the rollout's rewards
and how many videos it decoded in each phase (the K ranks of a sequence-parallel group split the decoding)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from sage_grpo.core import distributed
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.rewards.registry import RewardSpec
from sage_grpo.stages import evaluate as evaluation
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate, in_groups
from sage_grpo.stages.score import Scorer
from sage_grpo.stages.update import UpdateConfig

# Five prompts in batches of two: [0, 1], [2, 3], [4]; on two data-parallel ranks one of them runs a discarded batch.
PROMPTS = ["a red fox in snow", "a neon sign", "a cat on a sofa", "waves at dusk", "a kite over a hill"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sequence-parallel", type=int, default=1)
    args = parser.parse_args()
    distributed.init()
    parallel = distributed.ParallelLayout.build(args.sequence_parallel)
    adapter = tiny_hunyuan15(seed=0)
    adapter.enable_sequence_parallel(parallel)
    adapter.transformer.requires_grad_(True)
    build_engine(adapter.transformer, UpdateConfig(), accumulation_steps=1)  # ZeRO-3 partitions the transformer
    forwards, decoded = [], []
    adapter.transformer.register_forward_hook(lambda module, inputs, output: forwards.append(len(inputs)))
    decode = adapter.decode
    adapter.decode = lambda latents: decoded.append(len(latents)) or decode(latents)
    scorer = Scorer([RewardSpec(name="brightness")])
    scorer.setup(torch.device("cpu"))
    metadata = [{"index": i} for i in range(len(PROMPTS))]
    layout = f"world{distributed.world_size()}_k{args.sequence_parallel}"
    out = Path(args.out) / layout
    out.mkdir(parents=True, exist_ok=True)
    result = evaluation.evaluate(
        adapter,
        PROMPTS,
        SDEConfig(steps=3),
        scorer,
        seed=7,
        out_dir=out,
        batch_size=2,
        write_videos=3,
        write=distributed.is_main(),
        embeddings=adapter.encode_prompts(PROMPTS),
        prompt_metadata=metadata,
        parallel=parallel,
    )
    (out / f"forwards_rank{distributed.rank()}.txt").write_text(str(len(forwards)))
    decoded_in_evaluation, decoded[:] = sum(decoded), []
    rewards = score_a_rollout(adapter, scorer, parallel)
    report = {"rewards": rewards, "decoded": {"evaluation": decoded_in_evaluation, "rollout": sum(decoded)}}
    (out / f"rollout_rank{distributed.rank()}.json").write_text(json.dumps(report))
    if distributed.is_main():
        np.save(out / "frames.npy", result.frames)
        report = {
            "metrics": result.metrics,
            "prompts": result.prompts,
            "scores": result.scores,
            "videos": {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in result.videos},
        }
        (out / "report.json").write_text(json.dumps(report))


def score_a_rollout(adapter, scorer: Scorer, parallel: distributed.ParallelLayout) -> list[float | None]:
    """Two prompts x 2 samples in batches of one, each batch decoded and scored as soon as it is generated, as
    ``SageGRPORecipe.train_step`` does: its share of the batches on each rank of a sequence-parallel group, whose
    scores the group shares."""
    prompts = PROMPTS[:2]
    with scorer.overlapped(in_groups(prompts, 2), fps=adapter.fps) as sink:
        generate(
            adapter,
            prompts,
            2,
            SDEConfig(steps=3),
            seed=11,
            batch_size=1,
            progress=False,
            on_batch=sink.submit,
            decode_batches=parallel.sequence_share,
        )
        return sink.result(across=parallel.across_sequence_group).total


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
