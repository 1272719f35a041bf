"""Whether an optimizer update could teach the model anything, from sizes the update stage measured: the gradient's
RMS per coordinate against Adam's eps, the weights' RMS change per unit of learning rate, and each top-level module's
share of that change. Pure arithmetic, no I/O (``stages.master_weights`` measures the change).

Why these: Adam moves a coordinate by lr x m / (sqrt(v) + eps). While the gradient is far above eps that is about lr
whatever the gradient's scale (a step per unit of learning rate of ~1); once eps is comparable, the step shrinks by
|g| / (|g| + eps) and the run learns slower than its learning rate says (issue 49 measured ~0.6), with no other
metric out of place.
"""

from __future__ import annotations

import math


def top_level_name(parameter_name: str) -> str:
    """The direct child of the trained module that holds a parameter: ``transformer_blocks`` for
    ``transformer_blocks.3.attn.to_q.lora_A.default.weight``; a parameter of the trained module itself is its own."""
    return parameter_name.split(".", 1)[0]


def sample_strides(sizes: list[int], budget: int) -> list[int]:
    """Every how many-th coordinate to keep of each tensor of ``sizes`` so that at most ``budget`` are kept in all: 1
    (whole) for every tensor when they fit, else for every tensor up to a common cap, the larger ones sampled down
    to it (water-filling). So the small tensors (norms, biases, an embedder), whose share of a step could not be
    estimated from a few coordinates, are kept whole, and each large one keeps at least a third of the cap. A stride
    is odd so that it never lines up with a power-of-two row width and keeps the same columns of every row."""
    if sum(sizes) <= budget:
        return [1] * len(sizes)
    cap, remaining = 1, budget
    for kept, size in enumerate(sorted(sizes)):
        left = len(sizes) - kept
        if size * left > remaining:
            cap = max(1, remaining // left)
            break
        remaining -= size
    return [_odd(math.ceil(size / cap)) for size in sizes]


def _odd(stride: int) -> int:
    return stride if stride % 2 else stride + 1


def rms(sum_of_squares: float, coordinates: int) -> float:
    """Root mean square per coordinate of a vector whose squared norm is ``sum_of_squares``."""
    return math.sqrt(sum_of_squares / coordinates)


def gradient_signals(
    grad_norm: float, coordinates: int, *, adam_eps: float | None, gradient_clipping: float = 0.0
) -> dict[str, float]:
    """``grad_rms``: the RMS of the update's gradient (``grad_norm``: the norm of the gradient averaged over ranks and
    micro-steps, before clipping, as DeepSpeed reports it) over the ``coordinates`` trained. With ``adam_eps`` (Adam's
    updates only), ``grad_rms_over_eps``: the RMS of the gradient Adam steps with, after the ``gradient_clipping`` clip
    (0: none), over eps; below ~10, eps shrinks the step."""
    grad_rms = rms(grad_norm**2, coordinates)
    signals = {"grad_rms": grad_rms}
    if adam_eps is not None:
        clipped = min(1.0, gradient_clipping / grad_norm) if gradient_clipping > 0 and grad_norm > 0 else 1.0
        signals["grad_rms_over_eps"] = grad_rms * clipped / adam_eps
    return signals


def step_signals(squared_change: dict[str, float], coordinates: int, learning_rate: float) -> dict[str, float]:
    """From each top-level module's ||delta theta||^2 of one applied update (over every rank), the ``coordinates``
    trained and the learning rate the update stepped with: ``step_rms_per_lr``, the RMS change per coordinate over the
    learning rate, and ``update_share/<module>``, each module's share of ||delta theta||^2 (they sum to 1; left out
    when nothing moved, where a share has no meaning)."""
    total = sum(squared_change.values())
    signals = {"step_rms_per_lr": rms(total, coordinates) / learning_rate}
    if total > 0:
        signals |= {f"update_share/{name}": value / total for name, value in squared_change.items()}
    return signals


def mean_per_key(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the rows that hold it (the updates of one rollout that measured it)."""
    keys = dict.fromkeys(key for row in rows for key in row)
    return {key: math.fsum(row[key] for row in rows if key in row) / sum(key in row for row in rows) for key in keys}
