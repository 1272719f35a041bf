"""The one exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class UserError(Exception):
    """Bad input from the user (config, CLI flags, data): reported in one line, without a traceback."""

    exit_code = 2


# Exit status of a run that stopped on SIGTERM/SIGUSR1 after committing a checkpoint: EX_TEMPFAIL from sysexits.h,
# which the Kubernetes and Slurm manifests in infra/ map to "restart and resume".
RETRYABLE_EXIT_CODE = 75


class StoreUnavailable(Exception):
    """The checkpoint store stayed unreachable (endpoint down, bucket missing, throttled) past its retry bound.

    Nothing half-written counts (the manifest goes last) and the local staging is kept; the run should stop with
    RETRYABLE_EXIT_CODE so the scheduler restarts it, and ``--resume auto`` continues from the last commit. The
    message is one line with credentials masked."""

    exit_code = RETRYABLE_EXIT_CODE
