"""One live run per output folder.

Two runs writing one ``run.output_dir`` would both "complete" while one replaces the other's export, config and plots
and the audit loses lines. So a run holds an OS lock on ``<output_dir>/run.lock`` for its life, and a second run on
that folder is refused in one line naming the holder. The lock is ``fcntl.flock``: the kernel holds it for the open
file, so it goes away with the process however the process ends (a crash, SIGKILL, a node's reboot): no stale lock
file to remove by hand, no pid guessing. The file itself stays; holding it, not its existence, is the lock. Readers
(``export``, ``eval``, ``sample``) take no lock: they restore into folders of their own
(``pipeline.checkpointer``) and may run beside a live run.

The lock is advisory and as good as the filesystem's: local disks and NFSv4 honour ``flock`` between hosts; a
filesystem without locks (some FUSE mounts) would let two runs in, as without this lock.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO

from sage_grpo.core.errors import UserError
from sage_grpo.core.files import make_writable_folder

LOCK_FILE = "run.lock"


class OutputFolderLock:
    """``acquire`` at the run's start; held until ``release`` or the end of the process."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self, run_name: str) -> None:
        """Hold the folder (created if absent) for the run ``run_name``, or raise a UserError naming the live run
        that holds it."""
        make_writable_folder(self.path.parent, "run.output_dir")
        file = self.path.open("a+")  # not truncated before the lock is ours: the holder's record stays readable
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = _described(file.read())
            file.close()
            raise UserError(
                f"run.output_dir {self.path.parent} is in use by {holder}; wait for it to end, or give this run its "
                "own run.output_dir"
            ) from None
        file.seek(0)
        file.truncate()
        record = {
            "run": run_name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        file.write(json.dumps(record) + "\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor of the open file drops the flock
            self._file = None


def _described(text: str) -> str:
    """The holder's record as words; what a holder that had not written it yet (or garbage) leaves is just a run."""
    try:
        record = json.loads(text)
        return f"run {record['run']!r} (pid {int(record['pid'])} on {record['host']}, since {record['since']})"
    except (ValueError, KeyError, TypeError):
        return "another live run"
