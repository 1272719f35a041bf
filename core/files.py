"""Files that are whole or absent: the one atomic-write helper (temporary name beside the target, fsync, rename,
fsync of the folder), so a crash or a concurrent reader never sees half a file; folders moved into place whole; and
the content digest that checkpoints, exports and registered models are verified by."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sage_grpo.core.errors import UserError

CHUNK_BYTES = 8 * 1024 * 1024  # large files are read and copied in pieces this size, never whole into memory


def make_writable_folder(path: str | Path, key: str) -> Path:
    """``path`` as a folder this process can write, created with its parents if absent. A path that is a file, lies
    under one, or cannot be created or written is a UserError naming the config ``key``: a run checks its folders
    before it writes anything, instead of failing with a traceback once the model has loaded."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # the permission bits do not say it (root, read-only mounts)
            pass
    except FileExistsError:
        raise UserError(f"{key} {path} is a file, not a folder") from None
    except OSError as error:
        raise UserError(f"{key} {path}: cannot create or write to it ({error.strerror or error})") from None
    return path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for the caller to write (with any writer: safetensors, json, ...); on
    success it is fsynced and renamed over ``path``, on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield temporary
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as temporary:
        temporary.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def move_into_place(staging: str | Path, target: str | Path) -> None:
    """Replace the folder ``target`` (or nothing) by the folder ``staging``, so a reader finds the old folder or the
    new one, never a mix of their files."""
    staging, target = Path(staging), Path(target)
    if target.exists():
        # os.replace cannot overwrite a non-empty folder; moving the old one aside keeps the target from ever being
        # a mix of old and new files.
        discarded = target.with_name(f".discarded-{target.name}-{uuid.uuid4().hex}")
        os.replace(target, discarded)
        os.replace(staging, target)
        shutil.rmtree(discarded, ignore_errors=True)
    else:
        os.replace(staging, target)
    fsync_dir(target.parent)


def sha256_and_size(path: str | Path) -> tuple[str, int]:
    """The sha256 (hex) of a file's contents and its size in bytes, read once in pieces."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def file_sha256(path: str | Path) -> str:
    return sha256_and_size(path)[0]


def fsync_dir(path: str | Path) -> None:
    """Make a folder's entries (a rename, a new file) survive a power loss."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: str | Path) -> None:
    """Make every file under ``root``, its contents and its folder's entry, survive a power loss: for a tree written
    by other libraries (safetensors, huggingface_hub) before it is renamed into place."""
    for directory, _, files in os.walk(root):
        for name in files:
            with open(Path(directory) / name, "rb") as file:
                os.fsync(file.fileno())
        fsync_dir(directory)


def remove_abandoned(directory: str | Path, pattern: re.Pattern[str]) -> None:
    """Remove the folders in ``directory`` that a killed process left: named by ``pattern``, whose group ``pid`` is
    the process that made the folder, owned by this user, and that process gone (or this one, which has not made its
    own yet). A folder of a running process or another user, or named otherwise, is left alone."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = pattern.fullmatch(path.name)
        if match is None or path.is_symlink() or not path.is_dir() or path.lstat().st_uid != os.getuid():
            continue
        pid = int(match.group("pid"))
        if pid == os.getpid() or not _running(pid):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # exists, another user's
        return True
    return True
