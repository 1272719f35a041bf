"""Stop signals (SIGTERM from Kubernetes and torchrun, SIGUSR1 from Slurm before its time limit) end a run with the
retryable exit code, whatever it is doing: outside the training loop at once (``retryable_signals``), inside it once
the iteration is checkpointed (``preemption_signals``). Standard library only, so a command installs the first before
its slow imports (torch, DeepSpeed, the model) start."""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE

logger = logging.getLogger(__name__)


@contextmanager
def preemption_signals(grace_s: float):
    """SIGTERM (Kubernetes, torchrun) and SIGUSR1 (Slurm's pre-timeout signal) ask the run to finish the current
    iteration, checkpoint and exit with the retryable code; yields a function telling whether one arrived. If that
    takes longer than ``grace_s``, the process exits with the retryable code at once (a watchdog thread): what was
    committed stays committed (a half-written step has no manifest), and the restart resumes from it."""
    received = []

    def on_signal(signum, frame):
        if not received:
            watchdog = threading.Timer(grace_s, _exit_retryable, args=(signal.Signals(signum).name, grace_s))
            watchdog.daemon = True
            watchdog.start()
        received.append(signum)

    handled = (signal.SIGTERM, signal.SIGUSR1)
    previous = {sig: signal.signal(sig, on_signal) for sig in handled}
    try:
        yield lambda: bool(received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def retryable_signals():
    """Outside the training loop (start-up, the export and publishing at the end, the ``export`` command),
    SIGTERM and SIGUSR1 end the process at once with the retryable code, as the grace-period watchdog does: nothing
    there can be torn (a checkpoint counts once its manifest exists, an export is renamed into place whole and a
    killed one's staging is removed at the next start), and the restart does it again. The training loop's own
    handler (:func:`preemption_signals`) takes over while it runs."""

    def on_signal(signum, frame):
        logger.error("%s outside the training loop: exiting with %d", signal.Signals(signum).name, RETRYABLE_EXIT_CODE)
        _exit_now()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_retryable(signal_name: str, grace_s: float) -> None:
    logger.error(
        "%s: the iteration and its checkpoint did not finish within run.preemption_grace_s=%gs; exiting "
        "with %d without a new checkpoint (resume continues from the last committed one)",
        signal_name,
        grace_s,
        RETRYABLE_EXIT_CODE,
    )
    _exit_now()


def _exit_now() -> None:
    logging.shutdown()
    os._exit(RETRYABLE_EXIT_CODE)
