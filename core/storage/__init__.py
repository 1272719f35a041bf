"""Checkpoint storage: one interface for local paths, ``file://`` and ``s3://`` roots.

Layout under a root::

    <root>/owner.json               the run that owns this root (claimed on its first commit)
    <root>/step-N/<files>           everything the pipeline staged for step N
    <root>/step-N/manifest.json     written last: path, size and sha256 of every file, world size, config hash, run
    <root>/latest                   "N\\n", moved only after step N's manifest exists
    <root>/set-aside-step-N-<time>  a step that failed verification or another run wrote, moved aside, never deleted

This is the fix for DeepSpeed writing its own ``latest`` before every rank has finished. Each module reads top to
bottom:

- ``store.py``: the commit protocol (:class:`CheckpointStore`): commit, ownership, verify, resolve, prune, outages;
- ``manifest.py``: what a committed step holds (:class:`Manifest`) and the checks against it;
- ``local_store.py`` and ``s3_store.py``: the two backends, which only move bytes;
- ``locations.py``: storage URIs in their canonical form;
- ``config.py``: the ``checkpoint`` section (:class:`CheckpointConfig`), which builds a store;
- ``loading.py``: tensors read back without unpickling arbitrary objects.
"""

from sage_grpo.core.storage.config import CheckpointConfig, MiB
from sage_grpo.core.storage.loading import load_tensors, load_torch
from sage_grpo.core.storage.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    OWNER_NAME,
    CheckpointError,
    FileEntry,
    Manifest,
    checked_relpath,
    step_dir,
)
from sage_grpo.core.storage.store import CheckpointStore, RootClaimedError, StorageBackend, StorageError

__all__ = [
    "LATEST_NAME",
    "MANIFEST_NAME",
    "OWNER_NAME",
    "MiB",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointStore",
    "FileEntry",
    "Manifest",
    "RootClaimedError",
    "StorageBackend",
    "StorageError",
    "checked_relpath",
    "load_tensors",
    "load_torch",
    "step_dir",
]
