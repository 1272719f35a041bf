"""The DeepSpeed engine the update trains on: the ``deepspeed`` config section, the shipped and user JSONs (loaded
and checked when the config is validated, their "auto" fields filled from the run config), the optimizer, ZeRO-3's
leaf modules and ``build_engine``. The update (``stages.update.Updater``) only calls the engine it is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sage_grpo.core import distributed, flops
from sage_grpo.core.errors import UserError
from sage_grpo.core.lazy import lazy_module
from sage_grpo.stages.update import UpdateConfig

torch = lazy_module("torch", globals())

# Beside the packages in a checkout and in an installed wheel, which ships it as package data (pyproject.toml).
DEEPSPEED_CONFIGS = Path(__file__).resolve().parent.parent / "deepspeed_configs"


class DeepSpeedConfig(BaseModel):
    """The ``deepspeed`` section. The JSON is loaded and checked when the config is validated; its "auto" fields are
    filled from the run config when the engine is built, and a value it sets that disagrees with the run config is
    refused (as DeepSpeed's HF integration does), never silently overwritten."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    config: str = "zero3"  # a name in deepspeed_configs/ or a path to a JSON
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    collective_timeout_minutes: float = Field(30.0, gt=0, le=24 * 60, allow_inf_nan=False)
    # Module classes ZeRO-3 gathers whole, with one set of hooks, instead of hooking each submodule (DeepSpeed's
    # leaf modules). "auto": the model's own _no_split_modules, its transformer blocks, the unit FSDP wraps too, and
    # the largest other parts that hold layers (the time and text embeddings, the output norm).
    zero3_leaf_modules: Literal["auto"] | list[str] = "auto"

    @field_validator("config")
    @classmethod
    def _loadable(cls, name_or_path: str) -> str:
        load_deepspeed_json(name_or_path)
        return name_or_path

    def use_bf16(self) -> bool:
        return torch.cuda.is_available() if self.precision == "auto" else self.precision == "bf16"


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage a loaded DeepSpeed JSON runs (``load_deepspeed_json`` checked it): 0 when it names none."""
    return ds_config.get("zero_optimization", {}).get("stage", 0)


def partitions_parameters(stage: int) -> bool:
    """Whether ZeRO ``stage`` partitions the parameters themselves (ZeRO-3: each rank holds 1/world of every weight
    and gathers a layer for its forward), not only the optimizer state and gradients (stages 1 and 2)."""
    return stage == 3


def load_deepspeed_json(name_or_path: str) -> dict:
    """A shipped config by name (zero2, zero3, zero3_offload) or a user's JSON, checked for what this pipeline
    cannot run: problems are ValueErrors with one line (the config key is added by pydantic)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = DEEPSPEED_CONFIGS / f"{name_or_path}.json"
    shipped = ", ".join(sorted(p.stem for p in DEEPSPEED_CONFIGS.glob("*.json")))
    if not path.is_file():
        raise ValueError(f"{name_or_path!r}: no such DeepSpeed config (a path to a JSON, or one of {shipped})")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object, not a {type(config).__name__}")
    for block in ("optimizer", "scheduler"):
        if block in config:
            raise ValueError(
                f"{path}: its {block!r} block would replace the run's (update.optimizer, "
                "update.learning_rate, update.lr_schedule): remove it from the JSON"
            )

    # The blocks read below and filled from the run config must be objects: a shorthand such as "bf16": true would
    # otherwise fail as an AttributeError, or pass unchecked.
    def require_object(section: dict, key: str, key_path: str) -> None:
        if key in section and not isinstance(section[key], dict):
            raise ValueError(f"{path}: {key_path} must be a JSON object, not {json.dumps(section[key])[:40]}")

    for block in ("bf16", "fp16", "zero_optimization"):
        require_object(config, block, block)
    for block in ("bf16", "fp16"):
        if config.get(block, {}).get("enabled", "auto") not in (True, False, "auto"):
            raise ValueError(f'{path}: {block}.enabled must be true, false or "auto"')
    if config.get("fp16", {}).get("enabled") in (True, "auto"):
        raise ValueError(f"{path}: fp16 is not supported (log-densities need the range): use bf16 or fp32")
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if type(stage) is not int or stage not in (0, 1, 2, 3):  # a bool is an int: true would pass as stage 1
        raise ValueError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, not {json.dumps(stage)}")
    for offload in ("offload_optimizer", "offload_param"):
        require_object(zero, offload, f"zero_optimization.{offload}")
        device = zero.get(offload, {}).get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(
                f"{path}: zero_optimization.{offload}.device must be none, cpu or nvme, not {json.dumps(device)}"
            )
        if device == "nvme" and not zero[offload].get("nvme_path"):
            raise ValueError(f"{path}: zero_optimization.{offload} offloads to nvme but names no nvme_path")
        if device == "nvme" and not partitions_parameters(stage):
            raise ValueError(f"{path}: zero_optimization.{offload} to nvme needs ZeRO stage 3")
    return config


def deepspeed_config(
    name_or_path: str,
    *,
    micro_batch_size: int,
    accumulation_steps: int,
    max_grad_norm: float,
    bf16: bool,
    world_size: int | None = None,
    hidden_size: int | None = None,
) -> dict:
    """The JSON with its "auto" fields filled from the run config. A field the JSON sets to another value than the
    run's is a ValueError. With ``hidden_size``, "auto" ZeRO bucket sizes follow the model (HF's rule)."""
    config = load_deepspeed_json(name_or_path)
    required = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "gradient_clipping": max_grad_norm,
    }
    if world_size is not None:
        required["train_batch_size"] = micro_batch_size * accumulation_steps * world_size
    for key, value in required.items():
        _fill(config, key, value, name_or_path)
    _fill(config.setdefault("bf16", {}), "enabled", bf16, name_or_path, key_path="bf16.enabled")
    zero = config.get("zero_optimization", {})
    if hidden_size:
        for key, value in (
            ("reduce_bucket_size", hidden_size * hidden_size),
            ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
            ("stage3_param_persistence_threshold", 10 * hidden_size),
        ):
            if zero.get(key) == "auto":
                zero[key] = value
    return config


def _fill(section: dict, key: str, value, source: str, key_path: str | None = None) -> None:
    current = section.get(key, "auto")
    if current != "auto" and current != value:
        raise ValueError(
            f"deepspeed.config {source}: {key_path or key}={current} disagrees with the run config "
            f'({value}); set it to "auto" or to the same value'
        )
    section[key] = value


def check_optimizer_fits(optimizer: str, ds_config: dict) -> None:
    """Muon needs whole matrices, which only ZeRO-3's gathered parameters give DeepSpeed's implementation here."""
    if optimizer == "muon" and not partitions_parameters(zero_stage(ds_config)):
        raise ValueError("update.optimizer=muon is wired for ZeRO-3 configs only (zero3, zero3_offload)")


def _optimizer(params, config: UpdateConfig, offload: bool):
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            params, lr=config.learning_rate, betas=config.betas, eps=config.adam_eps, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(
        params,
        lr=config.learning_rate,
        betas=config.betas,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        foreach=torch.cuda.is_available(),
    )


def build_engine(
    module: torch.nn.Module,
    config: UpdateConfig,
    *,
    accumulation_steps: int,
    deepspeed_config_name: str = "zero3",
    bf16: bool = False,
    zero3_leaf_modules: Literal["auto"] | list[str] = "auto",
):
    """Wrap ``module`` (LoRA adapters already added, if any) in a DeepSpeed engine training its trainable params."""
    import deepspeed
    from deepspeed.utils import set_z3_leaf_module

    try:
        ds_config = deepspeed_config(
            deepspeed_config_name,
            micro_batch_size=config.micro_batch_size,
            accumulation_steps=accumulation_steps,
            max_grad_norm=config.gradient_clipping,
            bf16=bf16,
            world_size=distributed.world_size(),
            hidden_size=flops.hidden_size(module),
        )
    except ValueError as error:  # train_batch_size, which needs the world size, is known only now
        raise UserError(str(error)) from None
    # NVMe offload (ZeRO-Infinity) steps the optimizer on the host as CPU offload does: both need DeepSpeedCPUAdam.
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") in ("cpu", "nvme")
    if config.gradient_checkpointing and hasattr(module, "enable_gradient_checkpointing"):
        module.enable_gradient_checkpointing()
    if partitions_parameters(zero_stage(ds_config)):
        for leaf in zero3_leaves(module, zero3_leaf_modules):
            set_z3_leaf_module(leaf, True)
            if any(p.requires_grad for p in leaf.parameters()):  # a frozen leaf has no gradients to wait for
                leaf.register_forward_pre_hook(_inputs_require_grad, with_kwargs=True)
    trainable = [p for p in module.parameters() if p.requires_grad]
    check_optimizer_fits(config.optimizer, ds_config)
    if config.optimizer == "muon":
        # DeepSpeed's own Muon (Muon on the matrices, Adam on the rest and on every *embed* name), configured in its
        # JSON: a client optimizer would see ZeRO-3's flat partitions, and Muon needs whole matrices. The rest's Adam
        # is torch's AdamW, as with optimizer=adamw: DeepSpeed's fused CPU Adam restarts its bias correction from
        # pow(beta, step) where a run that was not resumed multiplied it up step by step, so a resume would drift by
        # float rounding.
        ds_config["optimizer"] = {
            "type": "muon",
            "params": {
                "lr": config.learning_rate,
                "weight_decay": config.weight_decay,
                "momentum": config.muon_momentum,
                "betas": list(config.betas),
                "eps": config.adam_eps,
                "torch_adam": True,
            },
        }
        ds_config.setdefault("zero_optimization", {})["reduce_scatter"] = False  # DeepSpeed's Muon requires it
        engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=trainable, config=ds_config, lr_scheduler=config.lr_scheduler
        )
        return engine
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=_optimizer(trainable, config, offload),
        config=ds_config,
        lr_scheduler=config.lr_scheduler,
    )
    return engine


def zero3_leaves(module: torch.nn.Module, class_names: Literal["auto"] | list[str]) -> list[torch.nn.Module]:
    """The outermost submodules of the named classes: ZeRO-3 fetches each one's parameters at once when it is entered
    and releases them when it is left, so a forward costs one fetch per block instead of one per linear layer and norm
    (and its outputs go through DeepSpeed's autograd wrappers once). The gathered block is what one GPU holds beyond
    its shard, as with FSDP's per-block wrapping: ~0.3 GB in bf16 for a HunyuanVideo 1.5 block.

    With "auto" the rest of the model is grouped too, as FSDP's root unit groups it: each largest submodule that holds
    no block but has layers of its own (the time and text embeddings, the output norm) is gathered whole, so those
    small layers cost one set of hooks per part instead of one per layer."""
    auto = class_names == "auto"
    names = set(getattr(module, "_no_split_modules", None) or []) if auto else set(class_names)
    present = {type(submodule).__name__ for submodule in module.modules()}
    if not auto and names - present:
        raise UserError(
            f"deepspeed.zero3_leaf_modules: {type(module).__name__} has no module of class "
            f"{', '.join(sorted(names - present))} (its classes include {', '.join(sorted(present)[:12])})"
        )
    leaves: list[torch.nn.Module] = []

    def visit(parent: torch.nn.Module) -> bool:
        """Collect the named leaves below ``parent`` and, with "auto", its other parts; whether it holds a leaf."""
        holding, others = False, []
        for child in parent.children():
            if type(child).__name__ in names:
                leaves.append(child)
                holding = True
            elif visit(child):
                holding = True
            else:
                others.append(child)
        if holding and auto:
            leaves.extend(child for child in others if next(child.children(), None) is not None)
        return holding

    visit(module)
    return leaves


def _inputs_require_grad(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Let a leaf's floating-point inputs require grad in a grad-enabled forward. DeepSpeed reduces a leaf's gradients
    in a full backward hook on the leaf, which fires once the gradients of its inputs exist; when none of its inputs
    requires grad (the patch embedding and the text refiner always, the first block under LoRA) it fires before the
    leaf's own parameter gradients are accumulated, and the backward fails on a released parameter. The same trick
    as transformers' enable_input_require_grads; it costs the gradient of those inputs."""
    if not torch.is_grad_enabled():
        return None

    def lifted(value):
        if torch.is_tensor(value) and value.is_floating_point() and not value.requires_grad:
            # A view, not the new leaf itself: torch.autograd.grad refuses full backward hooks on leaf tensors.
            return value.detach().requires_grad_().view_as(value)
        return value

    return tuple(map(lifted, args)), {key: lifted(value) for key, value in kwargs.items()}
