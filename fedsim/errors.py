"""The one error type the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations


class FedsimError(Exception):
    """A problem the user can fix (bad config, unknown name, impossible request).

    The message is one line: what is wrong and how to fix it.
    """


class ConfigError(FedsimError):
    """The experiment configuration is invalid."""


class RunFailedError(FedsimError):
    """A run started but could not complete (e.g. too few client results)."""
