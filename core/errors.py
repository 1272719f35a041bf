"""The one exception type for user mistakes (the CLI prints its message on one line and exits 2), and the stops a
restart cures (one line, exit 75)."""

import errno
import os


class UserError(Exception):
    """Bad input from the user (config, CLI flags, data): reported in one line, without a traceback."""

    exit_code = 2


# Exit status of a run that stopped on SIGTERM/SIGUSR1 after committing a checkpoint: EX_TEMPFAIL from sysexits.h,
# which the Kubernetes and Slurm manifests in infra/ map to "restart and resume".
RETRYABLE_EXIT_CODE = 75


class RetryableStop(Exception):
    """A stop that a restart with ``--resume auto`` cures (a service down, a disk full): everything committed is kept.
    The message is one line with credentials masked; the CLI exits RETRYABLE_EXIT_CODE and adds ``advice``, what to
    do next (a command with no run to resume, ``promote``, says its own)."""

    exit_code = RETRYABLE_EXIT_CODE
    advice = "restart with --resume auto"

    def __init__(self, message: str = "", advice: str | None = None):
        super().__init__(message)
        if advice is not None:
            self.advice = advice


class StoreUnavailable(RetryableStop):
    """The checkpoint store stayed unreachable (endpoint down, bucket missing, throttled) past its retry bound.

    Nothing half-written counts (the manifest goes last) and the local staging is kept; the run should stop with
    RETRYABLE_EXIT_CODE so the scheduler restarts it, and ``--resume auto`` continues from the last commit. The
    message is one line with credentials masked."""


# A full disk or quota reaches us as an OSError with its errno, or in the words of a library that writes on its own:
# the C library's message (safetensors: "No space left on device (os error 28)"), or torch's zip writer, whose
# failed writes ("basic_ios::clear: iostream error", then "unexpected pos N vs M") carry no errno at all.
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_WORDS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "iostream error", "unexpected pos ")


def out_of_space(error: BaseException | None) -> bool:
    """Whether ``error``, or one it was raised from or while handling, is a write that found no space left."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _NO_SPACE_ERRNOS:
            return True
        if any(words in str(error) for words in _NO_SPACE_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def first_line(error: BaseException) -> str:
    """``error``'s message cut to its first line (300 characters), or its type's name when it has none."""
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__
