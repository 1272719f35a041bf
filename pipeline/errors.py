"""The one exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class UserError(Exception):
    """Bad input from the user (config, CLI flags, data): reported in one line, without a traceback."""

    exit_code = 2
