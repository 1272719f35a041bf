"""DeepSpeed's JIT-built ops, and the lock that can stall every run that loads them.

DeepSpeed builds some ops on first use (on CPU: its shared-memory communication op, loaded by
``deepspeed.init_distributed``, and ``cpu_adam`` for optimizer offload) through torch's ``cpp_extension``, which
guards each op's build folder with ``<folder>/lock``: created with O_EXCL, removed when the build or load ends.
A process killed in between leaves the lock behind, and every later process then waits in ``FileBaton.wait``
forever, printing nothing. With the cache on a shared volume, one killed pod stalls every later pod.

``clear_stale_locks`` runs before DeepSpeed loads anything. A lock is stale when no process on this machine has it
open (torch keeps the lock's file descriptor open for the whole build) and nothing in its folder has been written
for ``stale_after_s`` (a live build writes an object file at least every few minutes, on any machine sharing the
cache). A stale lock is taken over: a warning names it and it is removed. Taking over rather than stopping with an
error, because the lock guards no data, only a rebuild, and an error would turn a silent hang into a restart loop
that needs a person; the quiet bound is what keeps a slow live build on another machine from being raced.
A lock held by a live process here that has gone quiet as long is a stuck build: a one-line error names its pid
(removing that lock would let the stuck process delete a later holder's lock when it ends).
Waiting for a live build says what it waits for, once.

Each environment builds in its own folder (``use_this_environments_extensions_dir``): torch's default,
``~/.cache/torch_extensions/py311_cpu``, is one folder for every environment of a user, and torch's build rules hold
the include paths of the environment that built an op, so two venvs (or a clean clone's) rebuilt each other's ops
and waited on each other's locks for minutes. ``$TORCH_EXTENSIONS_DIR``, where set (the image's shared ``/cache``,
Slurm's job folder), is used as it is.

``prebuild_ops`` builds the ops at set-up (``scripts/setup.sh``), so no training run builds them. A built op can
still be stale for this environment where several share a folder through ``$TORCH_EXTENSIONS_DIR``: another
environment rebuilds it for its own paths, and this one's next run would rebuild it back in the middle of that run.
So set-up records, in the environment, each op's build rules as it last loaded them, and loads the ops again (torch's
ninja build rebuilds only what changed) whenever the folder no longer holds those rules.

One environment can be reached by several paths (a symlink to it, a bind mount under another name). The folder is
named by the resolved path, so every path shares it, and ``use_this_environments_resolved_path`` (run before torch is
imported: by the command line, and by ``prebuild_ops``) imports the environment's packages through that resolved path
too, so torch's include paths and DeepSpeed's sources are the same in every build rule: otherwise each path's
process saw the other's build as out of date and the ops were rebuilt in turn, a minute each on CPU.

``use_this_environments_ninja`` runs before either: torch runs ``ninja`` from PATH, and an environment's
interpreter started without activating it (``.venv/bin/python``, a console script, a subprocess) finds the system's
ninja instead of its own. Ninja 1.13 hashes the commands in an op folder's build log with rapidhash (log v7), earlier
versions with MurmurHash2, so when two processes build with ninjas on either side, each one's build looks out of date
to the other and is redone (about a minute per load on CPU, while every other process waits on the lock): measured
four rebuilds in one run of the test suite (the venv's ninja 1.13, the system's 1.11).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from sage_grpo.core.errors import UserError

log = logging.getLogger(__name__)

STALE_AFTER_S = 300.0
# The CPU ops DeepSpeed loads in this project, by build folder: communication (every run), Adam (optimizer offload).
CPU_OPS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder"}
# In the environment (sys.prefix): each op's build rules as this environment's set-up last loaded them.
STAMP_NAME = ".sage-grpo-deepspeed-ops.json"


def extensions_root() -> Path:
    """Where torch builds this environment's extensions: ``$TORCH_EXTENSIONS_DIR`` as is, else this environment's own
    folder beside torch's default (``~/.cache/torch_extensions/py311_cpu-env-<digest of sys.prefix>``; torch's rule,
    ``cpp_extension._get_build_directory``, is private)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    environment = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return Path(get_default_build_root()) / f"{python}_{accelerator}-env-{environment}"


def use_this_environments_extensions_dir() -> Path:
    """Point torch (and so DeepSpeed) at this environment's own extensions folder where ``$TORCH_EXTENSIONS_DIR`` is
    unset (see the module docstring); returns the folder. Child processes (torchrun's workers) inherit it."""
    root = extensions_root()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    return root


def use_this_environments_resolved_path() -> None:
    """Find this environment's packages through its resolved path from now on: the ``sys.path`` entries inside
    ``sys.prefix`` are rewritten under its real path (see the module docstring). Call it before torch and DeepSpeed are
    imported (a module already imported keeps the path it was found by). Child processes started with this interpreter
    (torchrun's workers) reach the environment by the same path as this one and call it again themselves."""
    prefix, resolved = sys.prefix, os.path.realpath(sys.prefix)
    if prefix == resolved:
        return
    inside = prefix + os.sep
    sys.path[:] = [
        resolved + entry[len(prefix) :] if entry == prefix or entry.startswith(inside) else entry for entry in sys.path
    ]
    importlib.invalidate_caches()


def use_this_environments_ninja(scripts: str | Path | None = None) -> None:
    """Put ``scripts`` (default: this interpreter's scripts folder, ``.venv/bin``) first on PATH when it holds a
    ``ninja`` and PATH would find another one first, as activating the environment does (see the module docstring).
    Child processes (torchrun's workers, the schedule's steps) inherit it."""
    scripts = str(scripts if scripts is not None else sysconfig.get_path("scripts"))
    own = shutil.which("ninja", path=scripts)
    if own is None or shutil.which("ninja") == own:
        return
    os.environ["PATH"] = os.pathsep.join([scripts, os.environ["PATH"]]) if os.environ.get("PATH") else scripts


def clear_stale_locks(
    root: str | Path | None = None, stale_after_s: float = STALE_AFTER_S, poll_s: float = 1.0
) -> list[Path]:
    """Wait for every op lock under ``root`` to be released, taking over the stale ones (see the module docstring).
    Returns the locks removed. Call once per machine before DeepSpeed loads an op."""
    root = Path(root) if root is not None else extensions_root()
    removed = []
    for lock in sorted(root.glob("*/lock")):
        if _wait_or_take_over(lock, stale_after_s, poll_s):
            removed.append(lock)
    return removed


def _wait_or_take_over(lock: Path, stale_after_s: float, poll_s: float) -> bool:
    told = False
    while True:
        try:
            inode = lock.stat().st_ino
        except FileNotFoundError:
            return False  # released
        holders = _local_holders(lock)
        quiet_s = time.time() - _last_write(lock.parent)
        if quiet_s > stale_after_s:
            if holders:
                raise UserError(
                    f"DeepSpeed op build in {lock.parent} (pid {', '.join(map(str, holders))}) has "
                    f"written nothing for {quiet_s:.0f} s and looks stuck: stop it and run again"
                )
            return _take_over(lock, inode, quiet_s)
        if not told:
            who = f"pid {', '.join(map(str, holders))}" if holders else "a process on another machine sharing the cache"
            log.warning(
                "waiting for the DeepSpeed op build in %s (%s) to release %s; taken over if nothing is "
                "written there for %.0f s",
                lock.parent,
                who,
                lock.name,
                stale_after_s,
            )
            told = True
        time.sleep(poll_s)


def _take_over(lock: Path, inode: int, quiet_s: float) -> bool:
    try:
        if lock.stat().st_ino != inode:
            return False  # another process took it over and holds a new lock since we looked
        lock.unlink()
    except FileNotFoundError:
        return False
    log.warning(
        "removed the stale DeepSpeed op lock %s (no process holds it, nothing written for %.0f s: a build "
        "or load was killed); the op is rebuilt or loaded normally",
        lock,
        quiet_s,
    )
    return True


def _last_write(folder: Path) -> float:
    """The newest modification time in an op's build folder (a build in progress keeps writing object files)."""
    times = [folder.stat().st_mtime]
    for entry in folder.iterdir():
        try:
            times.append(entry.stat().st_mtime)
        except FileNotFoundError:
            continue  # deleted while we looked (ninja replacing a file)
    return max(times)


def _local_holders(lock: Path) -> list[int]:
    """Processes on this machine with ``lock`` open (torch's FileBaton keeps the descriptor for the whole build)."""
    target = str(lock.resolve())
    holders = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                holders.append(int(fd_dir.parent.name))
        except OSError:
            continue  # a process that ended, or one we may not inspect
    return holders


def prebuild_ops(stamp: Path | None = None) -> None:
    """Build the CPU ops DeepSpeed uses here, or rebuild those another environment rebuilt since (see the module
    docstring), through DeepSpeed's own loader; skipped without importing DeepSpeed when ``stamp`` (default: in this
    environment, ``sys.prefix``) matches the cache. Nothing to do on other accelerators, whose images build their ops
    at install time (see the Dockerfile)."""
    use_this_environments_resolved_path()
    use_this_environments_ninja()
    root = use_this_environments_extensions_dir()
    if root.is_dir():
        clear_stale_locks(root)
    stamp = Path(sys.prefix) / STAMP_NAME if stamp is None else stamp
    if _recorded(stamp) == build_rules(root):
        print(f"DeepSpeed CPU ops already built for this environment in {root}")
        return
    if not _load_ops(root):
        return
    try:
        stamp.write_text(json.dumps(build_rules(root), sort_keys=True))
    except OSError as error:  # a read-only environment: the next set-up loads the ops again, which is only slower
        log.warning("could not record the DeepSpeed op build in %s (%s)", stamp, error)


def build_rules(root: Path) -> dict[str, str | None]:
    """Each op's build rules (sha256 of torch's ``build.ninja``, which names the include paths of the environment
    that built it), or None where the op is not built; and the version of the ninja that runs them (a switch to
    another ninja rebuilds every op once, see the module docstring)."""
    rules: dict[str, str | None] = {"ninja": _ninja_version()}
    for name in CPU_OPS:
        ninja = root / name / "build.ninja"
        built = ninja.is_file() and any((root / name).glob(f"{name}*.so"))
        rules[name] = hashlib.sha256(ninja.read_bytes()).hexdigest() if built else None
    return rules


def _ninja_version() -> str | None:
    ninja = shutil.which("ninja")
    if ninja is None:
        return None
    return subprocess.run([ninja, "--version"], capture_output=True, text=True, check=False).stdout.strip() or None


def _recorded(stamp: Path) -> dict | None:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def _load_ops(root: Path) -> bool:
    """Load every op through DeepSpeed (torch builds what is missing or stale); False off a CPU accelerator."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    for name in CPU_OPS:
        builder = get_accelerator().create_op_builder(CPU_OPS[name])
        if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            print(f"DeepSpeed op {name}: loading from {root / name}, built or rebuilt there if needed", flush=True)
            builder.load(verbose=False)
    return True
