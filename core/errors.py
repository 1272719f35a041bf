"""The one exception type for user mistakes (the CLI prints its message on one line and exits 2), the stops a
restart cures (one line, exit 75), and the two questions asked of any error: is it an outage (``is_outage``), and
what is its first line (``first_line``)."""

import errno
import os
import sys


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


def first_line(error: BaseException, *, with_type: bool = False) -> str:
    """``error``'s message cut to its first line (300 characters) with the credentials of any URI in it masked (the
    form in which an error is printed or logged; botocore and requests put endpoint URLs in their messages), or its
    type's name when it has none. ``with_type``: prefixed with the type's name, for errors of code we did not write
    (a user's reward), whose type says more than their message."""
    from sage_grpo.core.secrets import mask_uri  # core.secrets raises this module's UserError: imported on use

    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    line = mask_uri(lines[0])[:300]  # masked whole: a cut could leave a credential the mask no longer recognises
    return f"{type(error).__name__}: {line}" if with_type else line


# S3 answers that mean "not now" rather than "no": retrying (or restarting the run later) can succeed.
_S3_OUTAGE_CODES = {
    "NoSuchBucket",
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
}


def is_outage(error: BaseException) -> bool:
    """Whether a service's error means "not now" (unreachable, overloaded, throttled) rather than "no": what is left
    after the client's own retries, so retrying later, or a restart, is the cure.

    S3 (botocore, s3transfer): a connection failure, a 5xx, throttling or a missing bucket; access denied is a "no".
    MLflow (its exceptions, requests): a connection failure, a 5xx, 429, and 401/403 too (tracking treats a server
    refusing our credentials as one to try again later). An error of a library's class exists only once that library
    is imported, so this looks the classes up without importing any of them.
    """
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None and isinstance(error, botocore.ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.response.get("Error", {}).get("Code") in _S3_OUTAGE_CODES or status >= 500
    if botocore is not None and isinstance(error, botocore.BotoCoreError):
        return isinstance(error, (botocore.ConnectionError, botocore.HTTPClientError, botocore.IncompleteReadError))
    s3transfer = sys.modules.get("s3transfer.exceptions")
    if s3transfer is not None and isinstance(error, s3transfer.RetriesExceededError):
        return True
    mlflow = sys.modules.get("mlflow.exceptions")
    if mlflow is not None and isinstance(error, mlflow.MlflowException):  # it wraps connection failures as HTTP 500
        status = error.get_http_status_code()
        return status >= 500 or status in (401, 403, 429)
    requests = sys.modules.get("requests")
    return isinstance(error, (ConnectionError, TimeoutError)) or (
        requests is not None and isinstance(error, requests.RequestException)
    )
