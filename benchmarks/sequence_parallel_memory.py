"""Sequence parallelism K = 2 against K = 1 at the same video tokens, in bf16 (a run's precision): memory of one GRPO
update per rank, and whether K = 2 computes what K = 1 does.

One update of a HunyuanVideo 1.5 transformer (the tiny pipeline's classes, widened: 4 heads x 32, 2 layers, 64x64x9
video = 5 x 16 x 16 = 1,280 video tokens) under DeepSpeed ZeRO-3, launched by torchrun with K processes (one
sequence-parallel group, so both sides train the same samples). Each rank reports:

  activation bytes    the tensors autograd keeps for backward during a micro-step's forward (weights excluded),
                      the largest over the update's micro-steps: the part Ulysses divides by K (target <= 0.6x);
  peak CUDA bytes     torch.cuda.max_memory_allocated over the update (GPU only): everything, weights included;
  update seconds      the update's wall time;

and the first rank what the two layouts must agree on: one velocity of both prompts (CFG on), the rollout's latents,
and the update's gradient norm. Each is compared as |K2 - K1| / |K1| (norms over all elements) against
``BF16_LIMIT``; the last line says ``equivalence: ok`` or ``FAILED`` (exit status 1).

    python -m benchmarks.sequence_parallel_memory [--dtype bfloat16|float32]

On one GPU the two K = 2 ranks share it (collectives over gloo, which NCCL cannot do with two ranks on one device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.perf import COMPUTE_BOUND_TRANSFORMER
from benchmarks.ranks import launch

# Largest |K2 - K1| / |K1| accepted in bf16. K = 2 runs the same per-token matmuls on half the tokens and each head's
# attention over all of them, so the two differ only where kernels round bf16 (8 significant bits, unit roundoff
# 2^-8 = 3.9e-3) differently: measured at most 6.1e-3 on CPU (the CFG velocity; benchmarks/RESULTS.md). A misplaced
# token shard or a gradient not scaled by K errs by far more (half the tokens lost: 0.71; the gradient off by K = 2:
# 0.5; tests/unit/test_gpu_check.py).
BF16_LIMIT = 5e-2
# float32 rounds 2^16 times finer; its limit is tests/distributed/test_sequence_parallel.py's for K = 2 against K = 1.
LIMITS = {"bfloat16": BF16_LIMIT, "float32": 1e-5}
COMPARED = ("velocity", "latents", "grad_norm")

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


def worker(out: Path, dtype: str) -> None:
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
    precision = getattr(torch, dtype)
    adapter = tiny_hunyuan15(
        guidance_scale=2.0, seed=0, device=distributed.device(), dtype=precision, transformer=TRANSFORMER, **VIDEO
    )
    adapter.transformer.requires_grad_(True)
    adapter.enable_sequence_parallel(parallel)
    noise = torch.randn(len(PROMPTS), *adapter.latent_shape(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = adapter.predict_velocity(noise, torch.full((len(PROMPTS),), 0.9), adapter.encode_prompts(PROMPTS))
    sde_config = SDEConfig(variant="sage", eta=0.5, steps=2, shift=3.0)
    rollout = generate(adapter, PROMPTS, GROUP, sde_config, seed=0, batch_size=1, decode=False, progress=False)
    config = UpdateConfig(learning_rate=1e-4, micro_batch_size=1)
    samples, trained = rollout.num_samples, int(rollout.trained_steps.sum())
    engine = build_engine(
        adapter.transformer,
        config,
        accumulation_steps=config.accumulation_steps(samples, trained),
        bf16=precision is torch.bfloat16,
    )
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
        metrics = updater.update(rollout, advantages)
    if on_cuda:
        torch.cuda.synchronize()
    report = {
        "activation_bytes": saved.peak,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
        "update_seconds": time.perf_counter() - started,
    }
    Path(out, f"rank{distributed.rank()}_k{size}.json").write_text(json.dumps(report))
    if distributed.is_main():  # every rank of the group holds the whole velocity and rollout
        compared = {"velocity": velocity, "latents": rollout.latents}
        compared["grad_norm"] = torch.tensor(metrics["grad_norm"], dtype=torch.float64)
        torch.save({key: value.cpu() for key, value in compared.items()}, Path(out, f"compared_k{size}.pt"))
    distributed.exit_launched(0)


def relative_differences(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> dict[str, float]:
    """|two - one| / |one| per compared quantity, norms over all its elements in float64."""
    differences = {}
    for key in COMPARED:
        reference, other = one[key].double(), two[key].double()
        differences[key] = float((other - reference).norm() / reference.norm())
    return differences


def equivalence_lines(differences: dict[str, float], dtype: str) -> tuple[list[str], bool]:
    """One line per quantity and the verdict line; whether every difference is within the dtype's limit (a NaN is
    not)."""
    limit = LIMITS[dtype]
    lines = [
        f"{dtype} K=2 vs K=1 {key}: relative difference {value:.2e} (limit {limit:g})"
        for key, value in differences.items()
    ]
    ok = all(value <= limit for value in differences.values())
    lines.append(f"equivalence: {'ok' if ok else 'FAILED'}")
    return lines, ok


def measure(size: int, out: str, dtype: str) -> dict:
    """The K = ``size`` run's largest per-rank numbers."""
    launch(["-m", "benchmarks.sequence_parallel_memory", "--worker", out, "--dtype", dtype], world=size, timeout_s=900)
    reports = [json.loads(Path(out, f"rank{r}_k{size}.json").read_text()) for r in range(size)]
    return {key: max(r[key] for r in reports) if reports[0][key] is not None else None for key in reports[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=sorted(LIMITS), default="bfloat16")
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.dtype)
    with tempfile.TemporaryDirectory() as out:
        one, two = measure(1, out, args.dtype), measure(2, out, args.dtype)
        compared = [torch.load(Path(out, f"compared_k{size}.pt"), weights_only=True) for size in (1, 2)]
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
    lines, ok = equivalence_lines(relative_differences(*compared), args.dtype)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
