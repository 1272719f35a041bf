"""The local store: a directory tree on a local or shared filesystem (``/path`` or ``file:///path``).

Every write is durable and atomic: temp file + fsync + ``os.replace``. A step's directory is assembled aside
(``.incoming-step-N``) and renamed into place with its manifest already inside, so ``step-N`` never exists half
written. The root's owner record is created with a hard link, which fails if it exists: two runs claiming the same
root cannot both win.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

from sage_grpo.core.files import CHUNK_BYTES, atomic_write_bytes, file_sha256, fsync_dir, fsync_tree, move_into_place
from sage_grpo.core.storage.manifest import CheckpointError, step_dir


class LocalBackend:
    """Byte storage under a directory; keys are relative POSIX paths the store has already checked."""

    def __init__(self, root: Path):
        self.root = root
        self.uri = str(root)

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        atomic_write_bytes(self.root / key, data)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            atomic_write_bytes(temporary, data)
            os.link(temporary, path)  # fails if path exists: no window in which a second writer could win too
        except FileExistsError:
            return False
        finally:
            temporary.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True

    def upload_files(self, files: Sequence[tuple[Path, str]]) -> None:
        for source, key in files:
            (self.root / key).parent.mkdir(parents=True, exist_ok=True)
            _durable_copy(source, self.root / key)

    def download_files(self, files: Sequence[tuple[str, Path]]) -> None:
        for key, target in files:
            shutil.copyfile(self.root / key, target)

    def sizes(self, prefix: str) -> dict[str, int]:
        """Sizes of the regular files under ``prefix``. A link or any other kind of file there is a CheckpointError:
        reading through it would load what it points to (another step's state, a file outside the store)."""
        base = self.root / prefix
        if not base.is_dir():
            return {}
        sizes = {}
        for path in [base, *base.rglob("*")]:
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode):
                sizes[path.relative_to(base).as_posix()] = path.stat().st_size
            elif not stat.S_ISDIR(mode):  # lstat: a link is neither
                raise CheckpointError(f"{path} is a link or a special file, which a checkpoint may not contain")
        return sizes

    def sha256(self, keys: Sequence[str]) -> dict[str, str]:
        return {key: file_sha256(self.root / key) for key in keys}

    def child_dirs(self) -> list[str]:
        return [path.name for path in self.root.iterdir() if path.is_dir()] if self.root.is_dir() else []

    def delete_key(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.root / prefix)

    def move_tree(self, prefix: str, target: str) -> None:
        os.replace(self.root / prefix, self.root / target)
        fsync_dir(self.root)

    # --- A step's life: opened, filled under incoming(step), sealed (or abandoned) -------------------------------

    def incoming(self, step: int) -> str:
        # The same name for every rank (they share the filesystem when they upload here).
        return f".incoming-{step_dir(step)}"

    def open_step(self, step: int) -> None:
        # Clears what a crashed attempt left.
        shutil.rmtree(self.root / self.incoming(step), ignore_errors=True)
        (self.root / self.incoming(step)).mkdir(parents=True)

    def seal_step(self, step: int) -> None:
        fsync_tree(self.root / self.incoming(step))
        move_into_place(self.root / self.incoming(step), self.root / step_dir(step))

    def abandon_step(self, step: int) -> None:
        shutil.rmtree(self.root / self.incoming(step), ignore_errors=True)


def _durable_copy(source: Path, target: Path) -> None:
    with open(source, "rb") as reader, open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, CHUNK_BYTES)
        writer.flush()
        os.fsync(writer.fileno())
