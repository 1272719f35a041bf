"""What a committed step holds: the names in a checkpoint root, the manifest, and the checks that compare files with
it. No I/O beyond hashing the files a caller stages.

Manifest paths are untrusted input (anyone who can write to the bucket can write a manifest): any that could leave
the checkpoint (``..``, absolute paths, backslashes, NULs) are rejected when the manifest is parsed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sage_grpo.core.errors import UserError
from sage_grpo.core.files import sha256_and_size

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
OWNER_NAME = "owner.json"
SET_ASIDE = "set-aside-"
# Only canonical names: "step-007" would name step 7 but live at a different path than step_dir(7).
STEP_NAME = re.compile(r"step-(0|[1-9][0-9]*)")


class CheckpointError(UserError):
    """A checkpoint is missing, not committed, fails verification, or names paths outside itself."""


def step_dir(step: int) -> str:
    return f"step-{step}"


def checked_relpath(path: str) -> str:
    """``path`` if it is a plain relative POSIX path that stays inside its checkpoint, else CheckpointError."""
    parts = path.split("/")
    escapes = path.startswith("/") or any(part in ("", ".", "..") for part in parts)
    # Backslashes and NULs are path separators or terminators somewhere; neither belongs in a checkpoint name.
    if escapes or "\\" in path or "\0" in path:
        raise CheckpointError(f"checkpoint file path {path!r} is not a plain relative path inside the checkpoint")
    return path


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _stays_inside_checkpoint(cls, path: str) -> str:
        try:
            return checked_relpath(path)
        except CheckpointError as error:
            raise ValueError(str(error)) from None  # pydantic reports ValueErrors with the manifest's location


class Manifest(BaseModel):
    """What a committed step holds; ``extra`` carries pipeline facts such as eval metrics used by
    :meth:`~sage_grpo.core.storage.CheckpointStore.prune`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = 1
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    config_hash: str
    created: datetime
    files: tuple[FileEntry, ...]
    extra: dict[str, Any] = {}
    run_id: str | None = None  # the run that wrote the step; None in manifests from before roots were owned

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        try:
            return cls.model_validate_json(data)
        except ValidationError as error:
            raise CheckpointError(f"{where}: invalid manifest ({error.errors()[0]['msg']})") from None


def staged_files(local_dir: Path) -> list[tuple[Path, str]]:
    """Every file under ``local_dir`` with its path relative to it, sorted by that path; ValueError when there are
    none or one takes the manifest's name."""
    if not local_dir.is_dir():
        raise ValueError(f"checkpoint staging directory {local_dir} does not exist")
    staged = sorted(
        (
            (path, checked_relpath(path.relative_to(local_dir).as_posix()))
            for path in local_dir.rglob("*")
            if path.is_file()
        ),
        key=lambda item: item[1],
    )
    if not staged:
        raise ValueError(f"{local_dir} holds no files: refusing to commit an empty checkpoint")
    if any(relpath == MANIFEST_NAME for _, relpath in staged):
        raise ValueError(f"{local_dir}/{MANIFEST_NAME}: that name is reserved for the store's manifest")
    return staged


def file_entry(path: Path, relpath: str) -> FileEntry:
    sha256, size = sha256_and_size(path)
    return FileEntry(path=relpath, size=size, sha256=sha256)


def size_problems(manifest: Manifest, sizes: Mapping[str, int]) -> dict[str, str]:
    """What is wrong, per listed path, with the files found at ``sizes`` (path -> bytes): missing or resized."""
    problems = {}
    for entry in manifest.files:
        if entry.path not in sizes:
            problems[entry.path] = "missing"
        elif sizes[entry.path] != entry.size:
            problems[entry.path] = f"size {sizes[entry.path]}, manifest says {entry.size}"
    return problems


def raise_if_problems(where: str, problems: Mapping[str, str]) -> None:
    if problems:
        listed = "; ".join(f"{path}: {problem}" for path, problem in sorted(problems.items())[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{where} fails verification: {listed}{more}")


def best_step(manifests: Mapping[int, Manifest], metric: str, higher_is_better: bool) -> int | None:
    """The step whose ``extra[metric]`` is best (ties go to the newer step); None when no step has a number there."""
    scored = {}
    for step, manifest in manifests.items():
        value = manifest.extra.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # not NaN
            scored[step] = value if higher_is_better else -value
    return max(scored, key=lambda step: (scored[step], step), default=None)
