"""Model FLOPs and utilisation (MFU): pure arithmetic, no I/O.

A transformer's forward costs about 2 FLOPs per parameter per token (one multiply-add per weight in the matmuls)
plus the attention scores and their weighted sum, 4 x layers x sequence x width per token (PaLM's appendix B
accounting, without the causal halving: video attention is full). A backward costs twice the forward. MFU is the
model FLOPs a step needed, over the seconds it took times the devices' dense peak: recomputation (gradient
checkpointing), padding and the reference forwards that produce no gradient are work the hardware did but the model
count does not include, so MFU < hardware utilisation by design.
"""

from __future__ import annotations

# Dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from the vendors' data sheets (SXM parts).
PEAK_BF16_FLOPS = {
    "B200": 2.25e15,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


def forward_flops_per_token(parameters: int, layers: int, width: int, sequence: int) -> float:
    """FLOPs of one forward, per token of a ``sequence``-token input, for a transformer of ``parameters`` weights,
    ``layers`` attention layers and attention width ``width`` (heads x head dim)."""
    return 2.0 * parameters + 4.0 * layers * sequence * width


def hidden_size(module) -> int | None:
    """A transformer's attention width from its diffusers config (heads x head dim where it has no hidden_size);
    None when the config says neither. ``module``: any object with a ``config`` mapping."""
    config = getattr(module, "config", None) or {}
    if config.get("hidden_size"):
        return int(config["hidden_size"])
    if config.get("num_attention_heads") and config.get("attention_head_dim"):
        return int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return None


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device from its name (``torch.cuda.get_device_name()``), None when unknown."""
    name = device_name.upper()
    return next((peak for model, peak in PEAK_BF16_FLOPS.items() if model in name), None)


def mfu(model_flops: float, seconds: float, peak_flops_per_device: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: the FLOPs the model needed over what the devices could do in ``seconds``."""
    if seconds <= 0 or peak_flops_per_device <= 0 or devices < 1:
        raise ValueError("mfu needs seconds > 0, a positive peak and at least one device")
    return model_flops / (seconds * peak_flops_per_device * devices)
