"""A slice of real-width HunyuanVideo 1.5 blocks at the 480p token count, in bf16 with CFG, trained one step as the
run trains it (key-padding attention, gradient checkpointing, each gradient dropped once accumulated as ZeRO-3
reduces it away): its measured peak memory against the plan's trace of the same slice (``core.memory_trace``), the
attention kernel that ran, and its MFU from the traced model FLOPs. ``benchmarks/gpu_check.sh`` runs it on a GPU.

    python -m benchmarks.traced_block_check [--blocks 4] [--device cuda] [--results benchmarks/RESULTS.md]

Printed: ``attention kernel: NAME``, ``peak: measured X GiB, traced Y GiB (ratio R)``, ``MFU: M`` and a verdict
line ``traced-vs-measured: ok`` or ``... FAILED`` (exit 1) when the two peaks differ by more than ``--tolerance``.
On the CPU (``--device cpu``, what the unit test runs, at a tiny size) the peak is measured by torch's profiler.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

from sage_grpo.core import flops, memory_trace
from sage_grpo.core.models.hunyuan15 import fake_tensor_forward, use_key_padding_attention

GIB = 2**30
# 480p: 81 frames at 480 x 848 -> 21 x 30 x 53 latents; CFG runs both branches as one batch of 2.
LATENTS_480P = (21, 30, 53)


def build(config: dict, dtype, device):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    with memory_trace.default_dtype(dtype), torch.device(device):
        model = HunyuanVideo15Transformer3DModel.from_config(config)
    use_key_padding_attention(model)
    model.enable_gradient_checkpointing()
    return model


def real_inputs(model, call: memory_trace.TransformerCall, dtype, device) -> dict:
    """The traced call's inputs with values: the shapes ``core.memory_trace`` fakes."""
    with torch.device(device):
        inputs = memory_trace._hunyuanvideo15_inputs(model.config, call, dtype)
    inputs["hidden_states"].normal_()
    inputs["timestep"].fill_(500.0)
    for name in ("encoder_hidden_states", "encoder_hidden_states_2"):
        inputs["text"][name].normal_()
    return inputs


def train_step(model, inputs) -> None:
    fake_tensor_forward(model, **inputs).float().sum().backward()


def measured_peak(model, inputs, device) -> int:
    """Bytes the step allocates beyond what was allocated before it, at its most."""
    drops = [p.register_post_accumulate_grad_hook(memory_trace._drop_grad) for p in model.parameters()]
    try:
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            train_step(model, inputs)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        return profiled_cpu_peak(lambda: train_step(model, inputs))
    finally:
        for handle in drops:
            handle.remove()


def profiled_cpu_peak(step) -> int:
    """Bytes the CPU allocator held at most beyond what it held before ``step()``: every allocation and free torch's
    profiler records, in the order of their timestamps."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import OpTree

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    tree = OpTree(profiler.profiler.kineto_results)
    sizes = sorted((e.start_time_ns, e.typed[1].alloc_size) for e in tree.dfs() if e.typed[0] == _EventType.Allocation)
    running = peak = 0
    for _, size in sizes:
        running += size
        peak = max(peak, running)
    return peak


def attention_kernel(model, inputs, device) -> str:
    """The attention kernels one forward ran, by name, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as profiler:
        fake_tensor_forward(model, **inputs)
    names = {e.name for e in profiler.events()}
    found = sorted(n for n in names if any(k in n.lower() for k in ("flash", "efficient_attention", "cudnn_attention")))
    return ", ".join(found) or ", ".join(sorted(n for n in names if "scaled_dot_product" in n)) or "unknown"


def seconds_per_step(model, inputs, device, repeats: int = 3) -> float:
    train_step(model, inputs)  # warm-up: kernels chosen, allocator grown
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        train_step(model, inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def check(args) -> dict:
    dtype = getattr(torch, args.dtype)
    config = {**(args.transformer or {}), "num_layers": args.blocks}
    call = memory_trace.TransformerCall(2, tuple(args.latents), train=True, checkpointing=True)
    traced = memory_trace.trace_hunyuanvideo15(config, call, dtype=dtype)
    # Model FLOPs: a forward and backward without the checkpointed forward's recomputation.
    model_flops = memory_trace.trace_hunyuanvideo15(
        config, memory_trace.TransformerCall(2, tuple(args.latents), train=True), dtype=dtype
    ).flops
    model = build(config, dtype, args.device)
    inputs = real_inputs(model, call, dtype, args.device)
    measured = measured_peak(model, inputs, args.device)
    kernel = attention_kernel(model, inputs, args.device)
    seconds = seconds_per_step(model, inputs, args.device) if args.device == "cuda" else None
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = flops.peak_flops(device_name)
    return {
        "device": device_name,
        "blocks": args.blocks,
        "tokens": args.latents[0] * args.latents[1] * args.latents[2] + sum(call.text_tokens),
        "kernel": kernel,
        "measured": measured,
        "traced": traced.peak,
        "ratio": traced.peak / measured,
        "seconds": seconds,
        "mfu": None if seconds is None or peak is None else flops.mfu(model_flops, seconds, peak),
    }


def report(result: dict, tolerance: float) -> tuple[list[str], bool]:
    ok = abs(result["ratio"] - 1) <= tolerance
    mfu = "n/a (no GPU of known peak)" if result["mfu"] is None else f"{result['mfu']:.1%}"
    seconds = "" if result["seconds"] is None else f", {result['seconds']:.3f} s per step"
    lines = [
        f"slice: {result['blocks']} real-width block(s), {result['tokens']:,} tokens x 2 (CFG), bf16, "
        f"gradient checkpointing, on {result['device']}",
        f"attention kernel: {result['kernel']}",
        f"peak: measured {result['measured'] / GIB:.3f} GiB, traced {result['traced'] / GIB:.3f} GiB "
        f"(ratio {result['ratio']:.3f})",
        f"MFU: {mfu}{seconds}",
        f"traced-vs-measured: {'ok' if ok else 'FAILED'} (tolerance {tolerance:.0%})",
    ]
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--latents", type=int, nargs=3, default=list(LATENTS_480P), metavar=("F", "H", "W"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--results", type=Path, help="append the lines to this markdown file")
    args = parser.parse_args(argv)
    args.transformer = None
    lines, ok = report(check(args), args.tolerance)
    print("\n".join(lines))
    if args.results is not None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        block = [f"\n## GPU acceptance: traced plan vs measured ({stamp})\n", "```text", *lines, "```\n"]
        with args.results.open("a") as out:
            out.write("\n".join(block))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
