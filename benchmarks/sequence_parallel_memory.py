"""Memory of one GRPO update per rank with sequence parallelism K = 2 against K = 1, at the same video tokens.

One update of a HunyuanVideo 1.5 transformer (the tiny pipeline's classes, widened: 4 heads x 32, 2 layers, 64x64x9
video = 5 x 16 x 16 = 1,280 video tokens) under DeepSpeed ZeRO-3, launched by torchrun with K processes (one
sequence-parallel group, so both sides train the same samples). Each rank reports:

  activation bytes    the tensors autograd keeps for backward during a micro-step's forward (weights excluded),
                      the largest over the update's micro-steps: the part Ulysses divides by K (target <= 0.6x);
  peak CUDA bytes     torch.cuda.max_memory_allocated over the update (GPU only): everything, weights included;
  update seconds      the update's wall time.

    python -m benchmarks.sequence_parallel_memory [--device cpu|cuda]

On one GPU the two K = 2 ranks share it (collectives over gloo, which NCCL cannot do with two ranks on one device).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.perf import COMPUTE_BOUND_TRANSFORMER
from benchmarks.ranks import launch

TRANSFORMER = COMPUTE_BOUND_TRANSFORMER  # the perf benchmark's: 4 heads, so K = 2 divides them
VIDEO = {"height": 64, "width": 64, "num_frames": 9}
PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
GROUP = 2


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward, parameters' excluded, counted from the last
    ``reset``; ``peak`` keeps the largest count a ``reset`` closed."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.current: dict[int, int] = {}
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        weights = {p.untyped_storage().data_ptr() for p in self.module.parameters() if p.numel()}
        if storage.data_ptr() not in weights:
            self.current[storage.data_ptr()] = storage.nbytes()
        return tensor

    def reset(self) -> None:
        self.peak = max(self.peak, sum(self.current.values()))
        self.current = {}


def worker(out: Path) -> None:
    from sage_grpo.core import distributed
    from sage_grpo.core.grpo import group_advantages
    from sage_grpo.core.models.tiny import tiny_hunyuan15
    from sage_grpo.core.trust_region import TrustRegionConfig
    from sage_grpo.stages.engine import build_engine
    from sage_grpo.stages.rollout import SDEConfig, generate
    from sage_grpo.stages.update import UpdateConfig, Updater

    torch.set_num_threads(1)
    if torch.cuda.is_available() and int(os.environ["LOCAL_WORLD_SIZE"]) > torch.cuda.device_count():
        # Two ranks on one GPU: each takes it as its local device (DeepSpeed's engine selects cuda:LOCAL_RANK).
        os.environ["LOCAL_RANK"] = str(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    distributed.init()
    size = distributed.world_size()
    parallel = distributed.ParallelLayout.build(size)
    adapter = tiny_hunyuan15(seed=0, device=distributed.device(), transformer=TRANSFORMER, **VIDEO)
    adapter.transformer.requires_grad_(True)
    adapter.enable_sequence_parallel(parallel)
    sde_config = SDEConfig(variant="sage", eta=0.5, steps=2, shift=3.0)
    rollout = generate(adapter, PROMPTS, GROUP, sde_config, seed=0, batch_size=1, decode=False, progress=False)
    config = UpdateConfig(learning_rate=1e-4, micro_batch_size=1)
    samples, trained = rollout.num_samples, int(rollout.trained_steps.sum())
    engine = build_engine(adapter.transformer, config, accumulation_steps=config.accumulation_steps(samples, trained))
    updater = Updater(engine, adapter, config, TrustRegionConfig(strategy="none"), parallel=parallel)
    advantages = group_advantages(torch.arange(samples, dtype=torch.float32), rollout.group_ids)

    saved = SavedBytes(engine.module)
    backward = engine.backward

    def counted_backward(loss):
        saved.reset()  # the micro-step's forward is done: what it saved is what its backward needs
        return backward(loss)

    engine.backward = counted_backward
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        updater.update(rollout, advantages)
    if on_cuda:
        torch.cuda.synchronize()
    report = {
        "activation_bytes": saved.peak,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
        "update_seconds": time.perf_counter() - started,
    }
    Path(out, f"rank{distributed.rank()}_k{size}.json").write_text(json.dumps(report))
    distributed.exit_launched(0)


def measure(size: int, out: str) -> dict:
    """The K = ``size`` run's largest per-rank numbers."""
    launch(["-m", "benchmarks.sequence_parallel_memory", "--worker", out], world=size, timeout_s=900)
    reports = [json.loads(Path(out, f"rank{r}_k{size}.json").read_text()) for r in range(size)]
    return {key: max(r[key] for r in reports) if reports[0][key] is not None else None for key in reports[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker))
    with tempfile.TemporaryDirectory() as out:
        one, two = measure(1, out), measure(2, out)
    mib = lambda value: f"{value / 2**20:.1f} MiB"  # noqa: E731
    print(f"tokens per sample: 1,280 video + 44 text; device: {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print(
        f"activations per rank: K=1 {mib(one['activation_bytes'])}, K=2 {mib(two['activation_bytes'])}: "
        f"ratio {two['activation_bytes'] / one['activation_bytes']:.3f} (target <= 0.6)"
    )
    if one["cuda_peak_bytes"] is not None:
        print(
            f"peak CUDA memory per rank: K=1 {mib(one['cuda_peak_bytes'])}, K=2 {mib(two['cuda_peak_bytes'])}: "
            f"ratio {two['cuda_peak_bytes'] / one['cuda_peak_bytes']:.3f}"
        )
    print(
        f"update time: K=1 {one['update_seconds']:.2f} s, K=2 {two['update_seconds']:.2f} s: "
        f"ratio {two['update_seconds'] / one['update_seconds']:.2f}"
    )


if __name__ == "__main__":
    main()
