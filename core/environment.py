"""What a bug report needs about the machine beyond package versions: the accelerator stack (CUDA, NCCL, the
NVIDIA driver) and DeepSpeed's ops (which this project loads, whether this machine can build them, whether they are
built in this environment's extensions folder).

DeepSpeed's own ``ds_report`` prints every op it knows with colour codes; this report keeps to the ops this project
loads (``ops_cache.CPU_OPS`` on CPU; ``fused_adam`` on GPU) so the lines stay short enough to paste into an issue.
"""

from __future__ import annotations

from sage_grpo.core.ops_cache import CPU_OPS, extensions_root

GPU_OPS = ("fused_adam",)  # DeepSpeed's default Adam under ZeRO on GPUs


def accelerator_lines() -> list[str]:
    """CUDA runtime, NCCL and the driver; each says why it is absent rather than being left out."""
    import torch

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    lines = [f"cuda          {torch.version.cuda or 'none'}; devices: {', '.join(devices) or 'none (CPU)'}"]
    lines.append(f"nccl          {_nccl_version()}")
    lines.append(f"driver        {_driver_version()}")
    return lines


def _nccl_version() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none (no CUDA device)"
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError) as error:
        return f"unknown ({error})"


def _driver_version() -> str:
    try:
        import pynvml
    except ImportError:
        return "unknown (nvidia-ml-py not installed: the `gpu` extra)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return f"none ({error})"
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    finally:
        pynvml.nvmlShutdown()


def deepspeed_op_lines() -> list[str]:
    """One line per op this project loads: compatible (DeepSpeed can build it here) and where it is built."""
    import torch
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    root = extensions_root()
    names = GPU_OPS if torch.cuda.is_available() else tuple(CPU_OPS)
    lines = [f"torch ext dir {root}"]
    for name in names:
        builder = ALL_OPS.get(name)
        compatible = builder is not None and builder.is_compatible(verbose=False)
        built = any((root / name).glob("*.so"))
        lines.append(
            f"op {name:<18} {'compatible' if compatible else 'NOT compatible'}; "
            f"{'built' if built else 'not built (built on first use, or by scripts/setup.sh)'}"
        )
    return lines
