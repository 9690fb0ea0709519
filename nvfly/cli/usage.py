"""How the command line reports a user's mistake: one line on stderr and exit code 2, never a traceback."""
from __future__ import annotations

import argparse
from typing import NoReturn

USAGE_ERROR = 2  # the exit code of a user's mistake, as argparse's own


class UsageError(Exception):
    """A user's mistake on the command line: ``nvfly.cli.main`` prints it as one line and exits with
    ``USAGE_ERROR``."""

    def __init__(self, command: str, message: str) -> None:
        super().__init__(f"{command}: error: {message}")


class Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as UsageError (one line, pointing at --help) instead of printing the
    usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, f"{message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def help_text(doc: str) -> str:
    """A module docstring as --help shows it: without the reStructuredText literal quotes."""
    return doc.replace("``", "")
