"""Export the trained policy in diffusers formats: the LoRA adapter, or the whole transformer.

Both work on a module partitioned by ZeRO-3: every rank must call them (the gathers are collectives), rank 0 writes.

- ``export_lora``: ``pytorch_lora_weights.safetensors`` with diffusers' ``transformer.`` key prefix and the peft
  config in the file's ``lora_adapter_metadata`` (what ``LoraBaseMixin.save_lora_weights`` writes). diffusers
  0.42's ``HunyuanVideo15Pipeline`` has no LoRA loader mixin, so there is no ``pipe.load_lora_weights``; load it on
  the transformer instead::

      pipe = HunyuanVideo15Pipeline.from_pretrained(base)
      pipe.transformer.load_lora_adapter(export_dir, weight_name="pytorch_lora_weights.safetensors")

  (``prefix="transformer"`` is the default; without ``weight_name`` or ``use_safetensors=True`` this method only
  looks for a pickled ``.bin``.) The adapter's scale ``lora_alpha / r`` is folded into the ``lora_B`` weights and the
  config written says ``lora_alpha == r``: a loader that reads the config and one that ignores it (diffusers without
  metadata, ComfyUI and other tools that assume ``alpha == r``) both apply the adapter at the trained strength.
- ``export_full``: ``config.json`` and ``diffusion_pytorch_model*.safetensors`` (sharded with an index above 10 GB),
  loadable with ``HunyuanVideo15Transformer3DModel.from_pretrained(export_dir)`` (or the Wan class for Wan).
- ``export_policy``: whichever of the two fits the model (LoRA if it carries an adapter).

Each export also holds ``export.json``: the kind, the base model it applies to (``model``: the name
``core.models.build_adapter`` takes, ``hunyuan15``, ``wan``, a tiny one or a dotted factory, with the pretrained
checkpoint and keyword arguments; see :func:`model_record`) and the sha256 of every file. It appears at ``out_dir``
whole or not at all: it is written into a temporary sibling directory that is renamed into place. What it
replaces there can only be an earlier export (:func:`check_replaceable`): a folder holding anything else is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch
from huggingface_hub import save_torch_state_dict

from sage_grpo.core import distributed
from sage_grpo.core.errors import UserError
from sage_grpo.core.files import file_sha256, fsync_tree, make_writable_folder, move_into_place, remove_abandoned
from sage_grpo.core.lora import ADAPTER_NAME
from sage_grpo.core.secrets import mask_tree

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
TRANSFORMER_PREFIX = "transformer"  # the component name diffusers' LoRA loaders filter keys by
EXPORT_MANIFEST = "export.json"
HEADER_LENGTH_BYTES = 8  # a safetensors file opens with its JSON header's length, a little-endian u64
# diffusers' own names, so that ModelMixin.from_pretrained finds the weights and the shard index.
FULL_WEIGHTS_PATTERN = "diffusion_pytorch_model{suffix}.safetensors"
MAX_SHARD_SIZE = "10GB"  # diffusers' save_pretrained default

ExportKind = Literal["lora", "full"]
# An export being written (see _atomic_directory): a full copy of the weights, so one a kill left is removed.
STAGING_FOLDER = re.compile(r"\..+\.(?P<pid>[1-9][0-9]*)-[0-9a-f]{32}\.tmp")


def model_record(name: str, *, pretrained: str | None = None, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``export.json`` says about the base model: enough to build it again with
    ``build_adapter(name, path_or_hub_id=pretrained, **kwargs)`` (the run config's ``model.name``,
    ``model.pretrained`` and ``model.kwargs``), credentials masked (``core.secrets``). Refuses what JSON cannot hold
    rather than writing a record that cannot be read back."""
    record = {"name": name, "pretrained": pretrained, "kwargs": dict(kwargs or {})}
    try:
        json.dumps(record, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"model {name!r}: its kwargs cannot be recorded in {EXPORT_MANIFEST}: {error}") from None
    # The record travels with the weights into every registered version: a hub token in the kwargs must not.
    return mask_tree(record)


def export_policy(engine_or_module, out_dir: str | Path, *, model: dict[str, Any] | None = None) -> Path | None:
    """The LoRA adapter if the model carries one, else the whole transformer; see the two functions below. A module
    of several pipeline components (two-expert Wan 2.2) goes to :func:`export_components`."""
    module = getattr(engine_or_module, "module", engine_or_module)
    if hasattr(module, "export_components"):
        return export_components(engine_or_module, out_dir, model=model)
    if getattr(module, "peft_config", None):
        return export_lora(module, out_dir, model=model)
    return export_full(engine_or_module, out_dir, model=model)


def export_lora(
    transformer: torch.nn.Module, out_dir: str | Path, *, model: dict[str, Any] | None = None
) -> Path | None:
    """Write the ``default`` LoRA adapter of ``transformer`` to ``out_dir``, its scale folded into ``lora_B``;
    ``model`` (see :func:`model_record`) names the base model in ``export.json``. The path on rank 0, None
    elsewhere."""
    peft_config = getattr(transformer, "peft_config", {}).get(ADAPTER_NAME)
    if peft_config is None:
        raise ValueError(f"{type(transformer).__name__} has no LoRA adapter named {ADAPTER_NAME!r} to export")
    weights = _fold_scaling(_gathered_adapter_state(transformer), _adapter_scalings(transformer))
    if not distributed.is_main():
        return None
    with _atomic_directory(out_dir) as staging:
        _write_lora(staging, weights, peft_config)
        _write_export_manifest(staging, "lora", model)
    return Path(out_dir)


def _write_lora(folder: Path, weights: dict[str, torch.Tensor], peft_config) -> None:
    prefixed = {f"{TRANSFORMER_PREFIX}.{name}": tensor for name, tensor in weights.items()}
    metadata = {"format": "pt", "lora_adapter_metadata": _adapter_metadata(peft_config)}
    safetensors.torch.save_file(prefixed, folder / LORA_WEIGHT_NAME, metadata=metadata)
    _sort_header_metadata(folder / LORA_WEIGHT_NAME)


def export_full(engine_or_module, out_dir: str | Path, *, model: dict[str, Any] | None = None) -> Path | None:
    """Write the whole transformer of a DeepSpeed engine (consolidated from ZeRO-3 shards) or of a plain module;
    ``model`` as for :func:`export_lora`."""
    module = getattr(engine_or_module, "module", engine_or_module)
    if getattr(module, "peft_config", None):
        raise ValueError("the model carries LoRA adapters: export them with export_lora, not as full weights")
    state = _full_state_dict(engine_or_module, module)
    if not distributed.is_main():
        return None
    with _atomic_directory(out_dir) as staging:
        _write_full(staging, module, state)
        _write_export_manifest(staging, "full", model)
    return Path(out_dir)


def _write_full(folder: Path, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    module.save_config(folder)
    # Not module.save_pretrained: diffusers' version takes no state_dict and would save the empty ZeRO-3 shards.
    save_torch_state_dict(state, folder, filename_pattern=FULL_WEIGHTS_PATTERN, max_shard_size=MAX_SHARD_SIZE)


def export_components(engine_or_module, out_dir: str | Path, *, model: dict[str, Any] | None = None) -> Path | None:
    """A module of several pipeline components (``module.export_components()``: the pipeline's component name ->
    the attribute holding it, e.g. two-expert Wan 2.2's ``transformer`` and ``transformer_2``, the trained ones
    only): each in the subfolder of its component name, as a LoRA adapter (all carry one) or as full weights, with
    one ``export.json`` over all files. Load each into its component: ``pipe.load_lora_weights(export_dir /
    "transformer_2", weight_name=LORA_WEIGHT_NAME, load_into_transformer_2=True)``, or
    ``WanTransformer3DModel.from_pretrained(export_dir, subfolder="transformer_2")``."""
    module = getattr(engine_or_module, "module", engine_or_module)
    parts = {name: getattr(module, attribute) for name, attribute in module.export_components().items()}
    lora = all(getattr(part, "peft_config", None) for part in parts.values())
    if lora:
        weights = {name: _fold_scaling(_gathered_adapter_state(p), _adapter_scalings(p)) for name, p in parts.items()}
    else:
        state = _full_state_dict(engine_or_module, module)
    if not distributed.is_main():
        return None
    with _atomic_directory(out_dir) as staging:
        for name, attribute in module.export_components().items():
            folder = staging / name
            folder.mkdir()
            if lora:
                _write_lora(folder, weights[name], parts[name].peft_config[ADAPTER_NAME])
            else:
                prefix = f"{attribute}."
                own = {key.removeprefix(prefix): state.pop(key) for key in list(state) if key.startswith(prefix)}
                _write_full(folder, parts[name], own)
        _write_export_manifest(staging, "lora" if lora else "full", model)
    return Path(out_dir)


def read_export_manifest(export_dir: str | Path) -> dict:
    """``export.json`` of an export, after checking every file it lists against its sha256 (ValueError if not)."""
    export_dir = Path(export_dir)
    manifest_path = export_dir / EXPORT_MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{export_dir} is not an export: {EXPORT_MANIFEST} is missing")
    manifest = json.loads(manifest_path.read_text())
    for name, expected in manifest["files"].items():
        path = export_dir / name
        if not path.is_file() or file_sha256(path) != expected:
            raise ValueError(f"{path} is missing or does not match the sha256 in {EXPORT_MANIFEST}")
    return manifest


def _gathered_adapter_state(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights in peft's key format, whole, copied to CPU; under ZeRO-3 gathered on every rank."""
    from peft.utils import get_peft_model_state_dict

    adapter_params = [param for name, param in transformer.named_parameters() if ".lora_" in name]
    # modifier_rank=None: read-only, every rank gets the full tensors and nothing is scattered back afterwards.
    with _gathered(adapter_params, modifier_rank=None):
        state = get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
        # Copied inside the gather: outside it the partitioned parameters' data is released.
        return _owned_copies(state)


def _adapter_scalings(transformer: torch.nn.Module) -> dict[str, float]:
    """peft's ``scaling`` of each adapted layer (``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA, per-layer
    patterns included), by the layer's name as the adapter's state-dict keys spell it."""
    from peft.tuners.lora import LoraLayer

    return {
        name: float(layer.scaling[ADAPTER_NAME])
        for name, layer in transformer.named_modules()
        if isinstance(layer, LoraLayer) and ADAPTER_NAME in layer.scaling
    }


def _fold_scaling(weights: dict[str, torch.Tensor], scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """``lora_B`` (weight and bias) times its layer's scale: ``scale * B(A x)`` equals ``B'(A x)``, so the adapter
    then needs a scale of 1, which is what ``lora_alpha == r`` gives every loader."""
    folded = {}
    for key, tensor in weights.items():
        layer, marker, _ = key.partition(".lora_B.")
        if marker and scalings.get(layer, 1.0) != 1.0:
            tensor = (tensor.double() * scalings[layer]).to(tensor.dtype)
        folded[key] = tensor
    return folded


def _full_state_dict(engine_or_module, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    if _is_zero3_engine(engine_or_module):
        # DeepSpeed's own consolidation: one layer gathered at a time, so rank 0 never holds two copies on GPU.
        state = engine_or_module._zero3_consolidated_16bit_state_dict()
        return None if state is None else _owned_copies(state)
    return _owned_copies(module.state_dict())


def _owned_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor copied to CPU into storage of its own, one at a time (the original's memory can go before the
    next copy). On CPU, DeepSpeed's consolidation hands back views into the flat buffer a layer was gathered into,
    and a module's state_dict may hold views too; safetensors refuses a tensor that does not cover its storage."""
    owned = {}
    for name in list(state):
        owned[name] = state.pop(name).detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
    return owned


def _is_zero3_engine(engine_or_module) -> bool:
    partitioned = getattr(engine_or_module, "zero_optimization_partition_weights", None)
    return partitioned is not None and partitioned()


def _gathered(params: list[torch.nn.Parameter], modifier_rank: int | None) -> contextlib.AbstractContextManager:
    if any(hasattr(param, "ds_tensor") for param in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)
    return contextlib.nullcontext()


def _adapter_metadata(peft_config) -> str:
    """The peft config as diffusers stores it (JSON, keys prefixed by the component name, sets as lists), with the
    scale set to 1 because :func:`_fold_scaling` put it into the weights."""
    config = peft_config.to_dict() | {
        "lora_alpha": peft_config.r,
        "alpha_pattern": dict(peft_config.rank_pattern or {}),
        "use_rslora": False,
    }
    config = {
        f"{TRANSFORMER_PREFIX}.{key}": sorted(value) if isinstance(value, set) else value
        for key, value in config.items()
    }
    return json.dumps(config, indent=2, sort_keys=True)


def _sort_header_metadata(path: Path) -> None:
    """Rewrite a safetensors header with its ``__metadata__`` keys in sorted order, in place. safetensors writes them
    in a random order on every save (safetensors/safetensors#584), so the same adapter exported twice had two
    sha256s. Only the order changes: the same JSON in the same number of bytes, so every tensor keeps its offset."""
    with open(path, "r+b") as file:
        (length,) = struct.unpack("<Q", file.read(HEADER_LENGTH_BYTES))
        header = json.loads(file.read(length))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        canonical = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(canonical) > length:
            raise RuntimeError(f"{path}: its header re-encodes in {len(canonical)} bytes, more than its {length}")
        file.seek(HEADER_LENGTH_BYTES)
        file.write(canonical.ljust(length, b" "))  # safetensors pads its header with spaces too


def _write_export_manifest(directory: Path, kind: ExportKind, model: dict[str, Any] | None) -> None:
    files = {path.relative_to(directory).as_posix(): file_sha256(path) for path in _files_below(directory)}
    manifest = {"kind": kind, "model": model, "files": files}
    (directory / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def check_replaceable(out_dir: str | Path) -> None:
    """UserError unless writing an export to ``out_dir`` deletes nothing but an earlier export: ``out_dir`` is absent,
    an empty folder, or a folder holding exactly an export's files, each matching the sha256 in its ``export.json``.
    Anything else there (other models, a run's output folder, a checkpoint root, an export with a file added or
    changed) is someone's data, and replacing the folder would delete it. The folder it goes in is created if absent
    and must be writable: a read-only target, or one under a regular file, is refused before any model loads."""
    target = Path(out_dir)
    problem = _replacement_problem(target)
    if problem is not None:
        raise UserError(
            f"export target {target} {problem}: refusing to replace it (only an earlier export is replaced); "
            "export to a new or empty folder"
        )
    make_writable_folder(target.parent, f"export target {target}: its folder")


def _replacement_problem(target: Path) -> str | None:
    """Why replacing ``target`` could delete someone's data, None when it holds nothing or an earlier export."""
    if not target.exists() and not target.is_symlink():
        return None
    if target.is_symlink() or not target.is_dir():
        return "is not a folder"
    if not any(target.iterdir()):
        return None
    return _not_an_export(target)


def _not_an_export(directory: Path) -> str | None:
    """Why ``directory`` is not an export this module wrote, None when it is one."""
    try:
        listed = json.loads((directory / EXPORT_MANIFEST).read_text())["files"]
        present = {path.relative_to(directory).as_posix() for path in _files_below(directory)}
        if not isinstance(listed, dict) or present != set(listed) | {EXPORT_MANIFEST}:
            return f"is not empty and holds files that no {EXPORT_MANIFEST} there lists"
        read_export_manifest(directory)
    except (OSError, ValueError, KeyError, TypeError):
        return f"is not empty and is not an export (no valid {EXPORT_MANIFEST}, or files that do not match it)"
    return None


def _files_below(directory: Path) -> list[Path]:
    """Every file in ``directory`` and its subfolders (an export of several components has one per component)."""
    return sorted(path for path in directory.rglob("*") if path.is_file())


@contextlib.contextmanager
def _atomic_directory(out_dir: str | Path) -> Iterator[Path]:
    """A fresh sibling directory to write into; on success it replaces ``out_dir`` (only ever an earlier export:
    :func:`check_replaceable`), on failure it is removed."""
    target = Path(out_dir)
    check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target.parent, STAGING_FOLDER)
    staging = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex}.tmp")
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left there once it has been moved into place
