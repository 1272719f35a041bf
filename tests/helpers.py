"""What many tests need, in one place: a free loopback port, waiting for a server process to answer HTTP, launching
torchrun workers, a process group of one in the test's own process, and a one-layer video model adapter for the
update's loss path."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.models.base import PromptEmbeddings, VideoModelAdapter


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now (loopback only)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_answering(
    url: str,
    process: subprocess.Popen,
    timeout_s: float,
    *,
    on_failure: Callable[[], str],
    any_http_answer: bool = False,
) -> None:
    """Poll ``url`` until it answers (any HTTP status counts with ``any_http_answer``), the process dies, or the
    timeout passes; then raise with ``on_failure()`` (e.g. the server's log tail) after the caller's cleanup."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            if any_http_answer:
                return
            time.sleep(0.1)
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up:\n{on_failure()}")


def wait_for(predicate: Callable[[], object], process: subprocess.Popen) -> None:
    """Until ``predicate()`` holds, however slow the machine: the process reaches that moment or ends (a failure
    here); one that hangs is the per-test limit's to stop."""
    while not predicate():
        assert process.poll() is None, "the process ended before the moment the test waits for"
        time.sleep(0.02)


REPO = Path(__file__).resolve().parents[1]


def worker_environment(**extra: str) -> dict[str, str]:
    """The environment of a test's worker processes: the repo importable, one thread each (2 cores are shared)."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def sagegrpo(*argv: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """``sagegrpo ARGV...`` as a process from the repo root (the user rewards under tests/fixtures importable), its
    output captured; ``env`` adds to the worker environment."""
    return subprocess.run(
        [sys.executable, "-m", "sage_grpo.pipeline.cli", *argv],
        cwd=REPO,
        env=worker_environment(**{"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'fixtures'}", **env}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refused_in_one_line(capsys, argv: list[str], key: str) -> str:
    """Run the CLI in-process on ``argv``: exit 2, one line on stderr naming ``key`` (``key:``, ``key=`` or ``key ``)
    and nothing else; that line."""
    from sage_grpo.pipeline import cli

    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 2, (argv, captured.out[-300:])
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sagegrpo: error:"), captured.err
    assert re.search(rf"{re.escape(key)}[:= ]", lines[0]), (key, lines[0])
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def torchrun(nproc: int, *target: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC TARGET...`` on one node from the repo root; asserts it exited 0. ``target`` is
    a script and its arguments, or ``-m module ...``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--master-port={free_port()}",
        *target,
    ]
    result = subprocess.run(
        command, env=worker_environment(), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """This process as a world of one, as ``sagegrpo run`` starts without a launcher (gloo, a rendezvous file), so a
    DeepSpeed engine runs in-process. Afterwards no group is left and neither are the launcher variables
    ``distributed.init`` set: a later test in this process must see neither (its world size is its environment's)."""
    import deepspeed

    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    distributed.init()
    # Every ZeRO-3 engine built runs a full gc.collect() (deepspeed/runtime/zero/utils.py: defragment), which in a
    # test process walks every object of every module imported so far: about a second each. Those objects are old
    # and stay; frozen, the collector skips them.
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        # DeepSpeed's own teardown, not torch's alone: it also drops the groups DeepSpeed cached, which the next
        # world_of_one's engines would otherwise find stale ("Group ... is not registered").
        deepspeed.comm.destroy_process_group()
        distributed.shutdown()  # the rendezvous folder
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class LinearAdapter(VideoModelAdapter):
    """A one-layer "transformer" over the latent channels on ``device`` (``meta``: shapes and devices, no values)."""

    def __init__(self, device: str | torch.device = "cpu"):
        torch.manual_seed(0)
        self._device = torch.device(device)
        self.transformer = torch.nn.Linear(2, 2, device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def encoder_identity(self) -> str:
        return f"linear-{self._device.type}"

    def encode_prompts(self, prompts):
        return PromptEmbeddings({"text": torch.zeros(len(prompts), 3, device=self._device)})

    def latent_shape(self):
        return (2, 1, 2, 2)

    def predict_velocity(self, latents, sigma, embeddings, *, module=None):
        module = self.transformer if module is None else module
        return module(latents.movedim(1, -1)).movedim(-1, 1) * sigma.view(-1, 1, 1, 1, 1)

    def decode(self, latents):
        raise AssertionError("not decoded")


def linear_adapter(guidance_scale: float = 1.0, dtype: torch.dtype = torch.float32) -> LinearAdapter:
    """``model.name: tests.helpers:linear_adapter``: the one-layer adapter built from a run config, as the recipe's
    ``build_policy`` builds a model (it passes a guidance scale and a dtype; the model has neither)."""
    return LinearAdapter()


class SGDEngine(torch.nn.Module):
    """DeepSpeed's engine contract as the Updater uses it: gradients accumulate over the micro-steps of an update and
    the optimizer applies at its boundary."""

    def __init__(self, module, accumulation: int):
        super().__init__()
        self.module, self.accumulation, self.micro_steps = module, accumulation, 0
        self.optimizer = torch.optim.SGD(module.parameters(), lr=0.5)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self):
        return self.accumulation

    def backward(self, loss):
        (loss / self.accumulation).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.accumulation == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()

    def was_step_applied(self):
        return True

    def get_global_grad_norm(self):
        return None


@contextlib.contextmanager
def gone_and_running_pids() -> Iterator[dict[str, int]]:
    """A pid whose process is gone, one whose process runs, and this process's: the owners a leftover (a staging
    folder, a rendezvous folder) can name."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "600"])
    try:
        yield {"gone": gone.pid, "running": running.pid, "this": os.getpid()}
    finally:
        running.kill()
        running.wait()


def make_leftover(path: Path, kind: str = "folder", uid: int | None = None) -> Path:
    """A folder holding a weights file, a file, or a link to a folder at ``path``, owned by ``uid`` when given."""
    if kind == "folder":
        path.mkdir()
        (path / "weights.safetensors").write_bytes(b"a full copy of the weights")
    elif kind == "file":
        path.write_bytes(b"a file")
    else:
        target = path.with_name("link-target")
        target.mkdir()
        path.symlink_to(target, target_is_directory=True)
    if uid is not None:
        os.chown(path, uid, -1, follow_symlinks=False)
    return path
