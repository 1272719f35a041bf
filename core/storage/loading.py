"""Reading tensors back from a checkpoint or an export without unpickling arbitrary objects (DeepSpeed's own files
load through :mod:`core.safe_load`)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.safe_load import refusal_reason
from sage_grpo.core.storage.manifest import CheckpointError

torch = lazy_module("torch", globals())


def load_tensors(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file (adapter or exported weights)."""
    from safetensors.torch import load_file

    return load_file(str(path), device=device)


def load_torch(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """A ``torch.save`` file, always with ``weights_only=True``: unpickling arbitrary objects from a checkpoint
    would run whatever code whoever could write to the bucket put there. A file that is not plain data is a one-line
    CheckpointError (torch's own message goes on to advise turning the protection off)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointError(f"refusing to load {path}: {refusal_reason(error)}") from None
