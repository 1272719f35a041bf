"""Load DeepSpeed's checkpoint files as data: no code from a checkpoint ever runs.

DeepSpeed writes its engine state with ``torch.save`` (pickles) and reads it back with
``torch.load(..., weights_only=False)`` from several places: ``TorchCheckpointEngine.load`` (model states and every
ZeRO-1/2/3 optimizer partition, LoRA or full fine-tuning), ``stage3``'s universal-checkpoint loader and
``utils/zero_to_fp32`` (consolidation). A pickle is a program: whoever can write to the checkpoint bucket could plant
a file whose unpickling runs a command, and rewrite the manifest's size and sha256 to match it.

Choice: force ``weights_only=True`` on every ``torch.load`` made while DeepSpeed reads a checkpoint, with an explicit
allow-list of the few DeepSpeed types its files hold, instead of
- writing the engine state as safetensors + JSON ourselves: that re-implements DeepSpeed's ZeRO partition layout
  (per-rank flat fp32 groups, fragment maps, loss scaler, universal-checkpoint conversion) and has to follow it across
  DeepSpeed releases; the house rule is to use DeepSpeed's own checkpointing;
- authenticating manifests with an HMAC: it needs a key distributed to every job and every reader (eval, export,
  consolidation), and a leaked or misconfigured key turns the checkpoint back into code; unsigned old checkpoints
  would need an opt-out that users would leave on.

How: torch's own ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` override (documented in ``torch.load``: it wins over an explicit
``weights_only=False``) is set for the duration of the load, so it also covers DeepSpeed code paths we did not list,
and the allow-list is installed with ``torch.serialization.safe_globals``. Under ``weights_only`` an allowed class is
only created and given its saved attributes; nothing on the allow-list runs code on load. Before loading, every
``.pt`` file of the tag is scanned statically (``get_unsafe_globals_in_checkpoint``, no unpickling) so that a refusal
names the file and the global in one line; the forced ``weights_only`` load is the guarantee, the scan the message.

The allow-list is what DeepSpeed 0.19 writes for ZeRO-2 and ZeRO-3, fp32 and bf16, LoRA and full fine-tuning, with
and without CPU offload (measured with ``get_unsafe_globals_in_checkpoint`` on real engines; ``DynamicLossScaler`` is
what an fp16 config writes instead of ``LossScaler``). A DeepSpeed upgrade that adds a type makes loading fail with
a one-line message naming it, never silently unsafe.

Resuming on another number of ranks goes through DeepSpeed's universal checkpoint (``convert_to_universal``, then
``load_engine_checkpoint(..., universal=True)``): the conversion reads the same engine files and writes per-parameter
fp32 weights and Adam moments; it runs inside the same data-only context, and the files it writes are scanned and
loaded under it too.

The process-wide settings (an environment variable and torch's global allow-list) are restored on exit; a load
running concurrently in another thread would only be made stricter, never laxer.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

from sage_grpo.core.errors import UserError
from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())

logger = logging.getLogger(__name__)

_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
# torch raises if both are set; the opt-out must not defeat the context either.
FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class UnsafeCheckpointError(UserError):
    """A checkpoint file is not plain data (it references code outside the allow-list, or is not a torch.save zip)."""


def deepspeed_safe_globals() -> list[type]:
    """The DeepSpeed types its checkpoint files hold: plain data classes and an enum, none with load-time code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def data_only_torch_load() -> Iterator[None]:
    """Every ``torch.load`` inside runs with ``weights_only=True`` and DeepSpeed's allow-list; a refused file raises
    UnsafeCheckpointError. Wrap anything that makes DeepSpeed read a checkpoint (``engine.load_checkpoint``,
    ``deepspeed.utils.zero_to_fp32``, export or consolidation code)."""
    saved = {name: os.environ.pop(name, None) for name in (FORCE_WEIGHTS_ONLY, FORCE_NO_WEIGHTS_ONLY)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            yield
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"refusing to load a checkpoint file that is not plain data: {refusal_reason(error)}"
        ) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_data_only(directory: str | Path) -> None:
    """UnsafeCheckpointError naming the first ``.pt`` file under ``directory`` that references a global outside the
    allow-list or is not a ``torch.save`` zip; the files are read statically, never unpickled."""
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        for path in sorted(Path(directory).rglob("*.pt")):
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except (ValueError, RuntimeError, pickle.UnpicklingError) as error:
                raise UnsafeCheckpointError(f"{path}: not a torch.save checkpoint ({refusal_reason(error)})") from None
            if unsafe:
                raise UnsafeCheckpointError(
                    f"{path} references {', '.join(sorted(unsafe))}, which a checkpoint may "
                    "not contain (only tensors and DeepSpeed's own data types are loaded)"
                )


def load_engine_checkpoint(engine, load_dir: str | Path, tag: str, *, universal: bool = False, **options: Any) -> dict:
    """``engine.load_checkpoint(load_dir, tag=tag, **options)`` with every file loaded as data; the client state.

    Call it on every rank, in place of ``engine.load_checkpoint``. ``options`` are DeepSpeed's (e.g.
    ``load_module_strict=True``); a missing tag is an error here, where DeepSpeed would only log a warning.
    ``universal``: the tag is a universal checkpoint (``convert_to_universal``), written by any number of ranks.
    """
    check_data_only(Path(load_dir) / tag)
    with data_only_torch_load(), _universal_load(engine, universal):
        load_path, client_state = engine.load_checkpoint(str(load_dir), tag=tag, **options)
    if load_path is None:
        raise UserError(f"{load_dir}: DeepSpeed found no checkpoint with tag {tag!r}")
    return client_state or {}


@contextmanager
def _universal_load(engine, universal: bool) -> Iterator[None]:
    """DeepSpeed reads ``checkpoint.load_universal`` from the engine's config at load time
    (``engine.load_universal_checkpoint()``), and only there: switching it for one load lets the same engine resume
    either layout, where the JSON key would fix the choice when the engine is built, before the checkpoint is known."""
    before = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = before


def convert_to_universal(source: str | Path, target: str | Path) -> None:
    """Convert the DeepSpeed checkpoint folder ``source`` (one tag, any ZeRO stage) into a universal checkpoint in
    ``target``, which any number of ranks can load. DeepSpeed's own converter (``ds_to_universal.main``), in this
    process: every file it reads is scanned and loaded as data, like a load; one worker, because its worker pool
    would fork a process that holds torch's threads. ``inject_missing_state``: ZeRO-1/2 files of a model that is not
    tensor- or pipeline-parallel carry no ``universal_checkpoint_info``; the converter's default for it is right."""
    from deepspeed.checkpoint import ds_to_universal

    check_data_only(source)
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(target),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    printed = io.StringIO()  # the converter reports progress with print(): keep it out of the run's stdout
    with data_only_torch_load(), redirect_stdout(printed):
        ds_to_universal.main(args)
    logger.debug("ds_to_universal: %s", printed.getvalue())


def refusal_reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    unsupported = _UNSUPPORTED_GLOBAL.search(text)
    if unsupported:
        return f"it references {unsupported.group(1)}, which is not on the allow-list"
    # torch follows the reason with paragraphs of advice on turning the protection off: keep the first sentence.
    return text.split(". ")[0] or type(error).__name__
