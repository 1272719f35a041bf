"""Each rank's float32 master copy of the trainable weights, where the optimizer steps them, and one optimizer update's
change of them per top-level module of the trained model (``WeightStep``, read by ``stages.update.Updater``).

Where the master weights live: ZeRO-3 keeps this rank's partition of every parameter in the optimizer's flat fp32
sub-group buffers (``grad_position`` says where); ZeRO-1/2 and DeepSpeed's bf16 optimizer link each parameter to its
fragment of this rank's flat fp32 partition (``_hp_mapping``, None where the parameter lies on other ranks); without
either the optimizer steps the parameter itself. The bf16 weights the model computes with are not what to measure: a
step of lr 1e-5 on a weight of 1e-2 is below bf16's resolution, so most of them do not move on a given update while
the master weights do.

What it costs: a copy of the master weights before the update, kept to ``SAMPLED_COORDINATES`` per rank when there
are more (full fine-tuning at the paper's size) by taking every k-th coordinate of the largest parameters
(``core.learning_diagnostics.sample_strides``); a parameter's squared change is then its sample's mean square times
its local size. LoRA's adapters fit whole, and so do the small parameters of a full model: there the measurement is
exact.
"""

from __future__ import annotations

from sage_grpo.core import distributed
from sage_grpo.core.lazy import lazy_module, no_grad
from sage_grpo.core.learning_diagnostics import sample_strides, top_level_name

torch = lazy_module("torch", globals())

# 64 MiB of float32 per rank: whole for LoRA and the test models. Full fine-tuning at the paper's size (8.3B weights
# over 8 ranks, ~1e3 parameters) keeps ~1e4 weights of each large parameter on a rank: its squared change within ~1%
# for a step of Gaussian-like spread, a module's sum over hundreds of them closer still.
SAMPLED_COORDINATES = 1 << 24


def local_master_weights(param: torch.nn.Parameter, optimizer) -> torch.Tensor | None:
    """A flat view of this rank's float32 master values of ``param`` (empty where it holds none of them); None where
    they cannot be read in place (ZeRO-3 with its optimizer state swapped out to NVMe)."""
    if hasattr(param, "ds_id"):  # ZeRO-3: a slice of this rank's flat fp32 partition of the parameter's sub-group
        if getattr(optimizer, "swap_optimizer", False):
            return None
        group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
        return optimizer.fp32_partitioned_groups_flat[group].narrow(0, offset, numel)
    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2, bf16 optimizer: this rank's fragment, if it holds one
        mapping = param._hp_mapping
        return param.new_empty(0) if mapping is None else mapping.get_hp_fragment().reshape(-1)
    return param.detach().reshape(-1)


class WeightStep:
    """One optimizer update's ||delta theta||^2 per top-level module of ``module`` (``core.learning_diagnostics``),
    over every rank: :meth:`start` keeps this rank's master values before the update's first micro-step,
    :meth:`squared_change` compares them once the update was applied. ``coordinates``: how many weights train, all
    ranks together."""

    def __init__(self, module: torch.nn.Module, budget: int = SAMPLED_COORDINATES):
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.module_names = [top_level_name(name) for name, _ in named]  # one per parameter
        # Under ZeRO-3 a parameter's local tensor is empty; ds_numel is its whole size.
        self.coordinates = sum(getattr(p, "ds_numel", p.numel()) for p in self.params)
        # Partitioned master weights sum over ranks; replicated ones (no ZeRO) are whole on every rank.
        self._partitioned = any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in self.params)
        self.budget = budget
        self._strides: list[int] = []
        self._before: list[torch.Tensor] | None = None

    @no_grad
    def start(self, optimizer) -> None:
        """Keep this rank's (sampled) master values: the update's starting weights."""
        views = self._views(optimizer)
        if views is None:
            self._before = None
            return
        self._strides = sample_strides([view.numel() for view in views], self.budget)
        self._before = [view[::stride].clone() for view, stride in zip(views, self._strides)]

    @no_grad
    def squared_change(self, optimizer) -> dict[str, float] | None:
        """Each top-level module's ||delta theta||^2 since :meth:`start`, summed over ranks; None where the master
        weights cannot be read. Collective: every rank calls it (after the same applied update)."""
        views = self._views(optimizer) if self._before is not None else None
        if views is None or self._before is None:
            return None
        squared = dict.fromkeys(self.module_names, 0.0)
        for name, change in zip(self.module_names, self._parameter_changes(views, self._before).tolist()):
            squared[name] += change
        return distributed.all_reduce_sum(squared) if self._partitioned else squared

    def _parameter_changes(self, views: list[torch.Tensor], before: list[torch.Tensor]) -> torch.Tensor:
        """Each parameter's local ||delta||^2, estimated as its sample's mean square change times its local size, read
        back to the host at once: a sync per parameter would stall the GPU's queue."""
        changes = [
            (view[::stride].double() - kept.double()).pow(2).mean() * view.numel()
            if kept.numel()
            else view.new_zeros((), dtype=torch.float64)
            for view, kept, stride in zip(views, before, self._strides)
        ]
        return torch.stack(changes).cpu() if changes else torch.zeros(0, dtype=torch.float64)

    def _views(self, optimizer) -> list[torch.Tensor] | None:
        # Looked up on every call: a checkpoint load may have replaced the optimizer's buffers.
        views = []
        for param in self.params:
            view = local_master_weights(param, optimizer)
            if view is None:
                return None
            views.append(view)
        return views
