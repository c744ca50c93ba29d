"""One exception type for bad input: the CLI prints its one-line message and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, files, models). The message names the culprit."""

    exit_code = 2
