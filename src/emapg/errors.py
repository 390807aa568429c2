"""The errors a user causes and can fix: a config field, an override, a command's option, a data file, a run
folder or checkpoint, an index, a reward plugin, a missing optional package. Each is an :class:`EmapgError`,
and the CLI prints it as one line (exit 2); every other exception is a bug and shows its traceback. This module
lives apart from the config's schema so that code which only raises (the retrieval server, the rollout
backends) does not import torch and the whole config to do so; ``emapg.config`` re-exports ``ConfigError``."""

from __future__ import annotations

from typing import Any


class EmapgError(Exception):
    """A problem the user can fix, said in one line that names the field, the file or the option."""


class ConfigError(EmapgError, ValueError):
    """A user-fixable problem in a config file or an override; ``problems`` lists each one (a config with
    several wrong fields is reported once, all of them in one message)."""

    def __init__(self, message: str, problems: list[str] | None = None, partial: Any = None):
        super().__init__(message)
        self.problems = problems or [message]
        self.partial = partial  # what was built from the valid fields (the rest at their defaults), or None


class MissingPackage(EmapgError, ImportError):
    """An optional package a feature needs is not installed: the message names it and the install line."""


class CheckpointError(EmapgError, ValueError):
    """A checkpoint that cannot be read: the message names the folder and the damaged file."""
