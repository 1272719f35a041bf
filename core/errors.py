"""The one exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class UserError(Exception):
    """Bad input from the user (config, CLI flags, data): reported in one line, without a traceback."""

    exit_code = 2


# Exit status of a run that stopped on SIGTERM/SIGUSR1 after committing a checkpoint: EX_TEMPFAIL from sysexits.h,
# which the Kubernetes and Slurm manifests in infra/ map to "restart and resume".
RETRYABLE_EXIT_CODE = 75
