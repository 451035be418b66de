"""Errors meant for the person at the terminal: what failed, with which input, what to do."""


class EdgeInferError(Exception):
    """A failure the CLI reports as one line on stderr with a non-zero exit code."""

    exit_code = 1


class UsageError(EdgeInferError):
    """Bad input from the user (exit code 2, like argparse)."""

    exit_code = 2
