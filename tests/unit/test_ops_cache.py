"""A DeepSpeed op lock left by a killed build is taken over; a live build is waited for; a stuck one is named.

Everything happens in a temporary TORCH_EXTENSIONS_DIR: the real op cache is never touched.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from torch.utils import file_baton
from torch.utils.cpp_extension import get_default_build_root

from sage_grpo.core import ops_cache
from sage_grpo.core.errors import UserError
from sage_grpo.core.ops_cache import (
    CPU_OPS,
    build_rules,
    clear_stale_locks,
    extensions_root,
    prebuild_ops,
    use_this_environments_extensions_dir,
    use_this_environments_ninja,
)

pytestmark = pytest.mark.unit

HOUR_AGO = time.time() - 3600


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # restored after the test
    use_this_environments_ninja()  # as prebuild_ops does, so stamps written here name the ninja it will find
    return tmp_path


def op_folder(root, age_s=None):
    """A build folder as torch leaves it, with a lock; files dated ``age_s`` ago (None: now)."""
    folder = root / "deepspeed_shm_comm"
    folder.mkdir()
    for file in ("build.ninja", "shm.o", "lock"):
        (folder / file).write_text("")
    if age_s is not None:
        for path in (folder, *folder.iterdir()):
            os.utime(path, (time.time() - age_s,) * 2)
    return folder / "lock"


def hold(lock, seconds):
    """A process that holds ``lock`` as torch's FileBaton does (O_EXCL, fd open), then releases it."""
    code = (
        "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); "
        "time.sleep(float(sys.argv[2])); os.close(fd); os.remove(sys.argv[1])"
    )
    lock.unlink()
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def baton_waits(lock, timeout_s=3.0) -> bool:
    """Whether torch's own FileBaton.wait (where DeepSpeed's op load hangs) is still waiting after ``timeout_s``."""
    # torch's file_baton.py loaded on its own (it needs only os and time): importing torch would eat the timeout.
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('file_baton', sys.argv[2]); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "module.FileBaton(sys.argv[1]).wait()"
    )
    try:
        subprocess.run([sys.executable, "-c", code, str(lock), file_baton.__file__], timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        return True
    return False


def test_extensions_root_follows_torch_extensions_dir(extensions):
    assert extensions_root() == extensions


def test_a_stale_lock_hangs_torch_and_is_taken_over_with_a_warning(extensions, caplog):
    lock = op_folder(extensions, age_s=3600)
    assert baton_waits(lock)  # the bug: a later run would wait here forever
    with caplog.at_level(logging.WARNING, logger="sage_grpo.core.ops_cache"):
        assert clear_stale_locks(stale_after_s=300) == [lock]
    assert not lock.exists() and not baton_waits(lock)
    assert "removed the stale DeepSpeed op lock" in caplog.text and str(lock) in caplog.text


def test_a_lock_held_by_a_live_build_here_is_waited_for_not_removed(extensions, caplog):
    lock = op_folder(extensions)
    holder = hold(lock, seconds=1.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sage_grpo.core.ops_cache"):
        assert clear_stale_locks(stale_after_s=300, poll_s=0.1) == []
    assert time.monotonic() - started >= 1.0 and holder.wait(timeout=10) == 0  # the holder removed its own lock
    assert f"pid {holder.pid}" in caplog.text and caplog.text.count("waiting for the DeepSpeed op build") == 1


def test_a_live_holder_that_wrote_nothing_for_too_long_is_named_not_raced(extensions):
    lock = op_folder(extensions, age_s=3600)
    holder = hold(lock, seconds=30)
    for path in (lock, lock.parent):
        os.utime(path, (HOUR_AGO, HOUR_AGO))
    try:
        with pytest.raises(UserError, match=f"pid {holder.pid}.*looks stuck"):
            clear_stale_locks(stale_after_s=300)
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_recent_lock_without_a_holder_here_is_taken_over_once_quiet(extensions, caplog):
    # Another machine sharing the cache may be building: wait until the folder has been quiet for the bound.
    lock = op_folder(extensions)
    last_write = lock.parent.stat().st_mtime
    with caplog.at_level(logging.WARNING, logger="sage_grpo.core.ops_cache"):
        assert clear_stale_locks(stale_after_s=1.0, poll_s=0.1) == [lock]
    assert "waiting for the DeepSpeed op build" in caplog.text and "another machine" in caplog.text
    assert time.time() - last_write > 1.0  # not taken over before the folder had been quiet for the bound


def built_op(root, name, rules="include /env-a/torch/include"):
    """An op folder as torch's build leaves it: its build rules (naming the environment's include paths) and the .so."""
    (root / name).mkdir(exist_ok=True)
    (root / name / "build.ninja").write_text(rules)
    (root / name / f"{name}.so").write_text("")


def test_prebuild_skips_ops_built_for_this_environment_and_clears_their_stale_locks(
    extensions, tmp_path, capsys, monkeypatch
):
    for name in CPU_OPS:
        built_op(extensions, name)
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps(build_rules(extensions)))
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # built ops need no DeepSpeed import (setup stays fast)
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.write_text("")
    for path in (lock.parent, *lock.parent.iterdir()):
        os.utime(path, (HOUR_AGO, HOUR_AGO))
    prebuild_ops(stamp)
    assert not lock.exists()
    assert "already built for this environment" in capsys.readouterr().out


@pytest.mark.parametrize(
    "since",
    ["another environment rebuilt an op", "no set-up here yet", "an op was deleted", "another ninja runs the builds"],
)
def test_prebuild_loads_the_ops_again_when_the_cache_no_longer_holds_this_environments_build(
    extensions, tmp_path, monkeypatch, since
):
    """A second venv sharing the cache rebuilds an op for its own include paths; without loading again at set-up,
    this environment's next training run would rebuild it back mid-run (minutes, on every alternation)."""
    for name in CPU_OPS:
        built_op(extensions, name)
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps(build_rules(extensions)))
    if since == "another environment rebuilt an op":
        built_op(extensions, "deepspeed_shm_comm", rules="include /env-b/torch/include")
    elif since == "no set-up here yet":
        stamp.unlink()
    elif since == "another ninja runs the builds":  # its build log's hashes differ: it would rebuild every op
        monkeypatch.setattr(ops_cache, "_ninja_version", lambda: "0.0.1-elsewhere")
    else:
        (extensions / "cpu_adam" / "cpu_adam.so").unlink()
    loads = []

    def load(root):  # what DeepSpeed's loader leaves: every op built with this environment's rules
        loads.append(root)
        for name in CPU_OPS:
            built_op(root, name)
        return True

    monkeypatch.setattr(ops_cache, "_load_ops", load)
    prebuild_ops(stamp)
    assert loads == [extensions]
    assert json.loads(stamp.read_text()) == build_rules(extensions)
    prebuild_ops(stamp)  # recorded: the next set-up skips
    assert loads == [extensions]


def _bin_with_ninja(folder):
    folder.mkdir(parents=True)
    (folder / "ninja").write_text("#!/bin/sh\n")
    (folder / "ninja").chmod(0o755)
    return folder


@pytest.mark.parametrize("path_finds", ["the system's ninja", "no ninja", "this environment's ninja"])
def test_torch_builds_ops_with_this_environments_ninja_whatever_path_finds_first(tmp_path, monkeypatch, path_finds):
    """torch runs `ninja` from PATH; a venv's interpreter started without activation would find the system's, and
    two ninja versions building one op folder rebuild each other's build (ninja 1.13 and earlier hash their log
    differently)."""
    own, system = _bin_with_ninja(tmp_path / "venv" / "bin"), _bin_with_ninja(tmp_path / "usr" / "bin")
    elsewhere = {
        "the system's ninja": str(system),
        "no ninja": str(tmp_path),
        "this environment's ninja": f"{own}{os.pathsep}{system}",
    }[path_finds]
    monkeypatch.setenv("PATH", elsewhere)
    use_this_environments_ninja(own)
    assert shutil.which("ninja") == str(own / "ninja")
    assert os.environ["PATH"].split(os.pathsep).count(str(own)) == 1  # prepended once, only where needed
    assert os.environ["PATH"].endswith(elsewhere)


def test_an_environment_without_its_own_ninja_keeps_path(tmp_path, monkeypatch):
    system = _bin_with_ninja(tmp_path / "usr" / "bin")
    monkeypatch.setenv("PATH", str(system))
    (tmp_path / "venv-bin").mkdir()
    use_this_environments_ninja(tmp_path / "venv-bin")
    assert os.environ["PATH"] == str(system)


ROOT_AND_VARIABLE = (
    "import os; from sage_grpo.core.ops_cache import use_this_environments_extensions_dir; "
    "print(use_this_environments_extensions_dir()); print(os.environ['TORCH_EXTENSIONS_DIR'])"
)


def _extensions_folder_of(python, **env) -> str:
    """The folder ``python`` builds DeepSpeed's ops in when TORCH_EXTENSIONS_DIR is unset, and what it sets the
    variable to for its child processes (one line each)."""
    environment = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"} | env
    result = subprocess.run(
        [str(python), "-c", ROOT_AND_VARIABLE], env=environment, capture_output=True, text=True, timeout=300, check=True
    )
    root, variable = result.stdout.split()
    assert root == variable
    return root


def test_two_environments_build_their_ops_in_folders_of_their_own(tmp_path):
    """torch's default (~/.cache/torch_extensions/py311_cpu) is one folder for every venv of a user: two venvs would
    rebuild each other's ops and wait on each other's locks."""
    other = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True, timeout=120)
    # The other venv runs this checkout with this venv's packages, as a clean clone's venv would with its own.
    shared = os.pathsep.join([sysconfig.get_paths()["purelib"], str(Path(__file__).resolve().parents[2])])

    ours = _extensions_folder_of(sys.executable)
    theirs = _extensions_folder_of(other / "bin" / "python", PYTHONPATH=shared)

    assert ours != theirs
    assert Path(ours).parent == Path(theirs).parent == Path(get_default_build_root())  # still in the user's cache
    assert ours == _extensions_folder_of(sys.executable)  # the same folder at every start: ops built once


def test_a_torch_extensions_dir_that_is_set_is_kept(extensions):
    assert use_this_environments_extensions_dir() == extensions
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(extensions)
