"""The errors a user causes and can fix: a config field, an override, a command's option, a data file, a run
folder or checkpoint, an index, a reward plugin, a missing optional package. Each is an :class:`EmapgError`,
and the CLI prints it as one line (exit 2); every other exception is a bug and shows its traceback. This module
lives apart from the config's schema so that code which only raises (the retrieval server, the rollout
backends) does not import torch and the whole config to do so; ``emapg.config`` re-exports ``ConfigError``."""

from __future__ import annotations

import os
import stat
from pathlib import Path
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


class PeerStopped(EmapgError):
    """A process of a torchrun run that stops because another one did (whose own message says why)."""


class MissingPackage(EmapgError, ImportError):
    """An optional package a feature needs is not installed: the message names it and the install line."""


class CheckpointError(EmapgError, ValueError):
    """A checkpoint that cannot be read: the message names the folder and the damaged file."""


class NotAFile(EmapgError, ValueError):
    """A path emapg reads that is not a regular file: a FIFO waits for a writer for ever and a device such as
    /dev/zero never ends, so neither is read."""


def regular_file(path, what: str = "") -> None:
    """Refuse, naming ``path`` (and ``what`` it is, e.g. ``--config``), anything that exists and is not a regular
    file (symbolic links are followed); an absent path is the caller's to report."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise NotAFile(f"{what + ' ' if what else ''}{path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (a named pipe)" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise NotAFile(f"{what + ' ' if what else ''}{Path(path)}: {kind}, not a regular file; emapg reads "
                       "configs, data and run files only from regular files")


def not_utf8(e: UnicodeDecodeError) -> str:
    """Where a whole file's bytes stop being UTF-8, for a message after its name: ``line N: not UTF-8 text (byte
    0xNN)``."""
    line = e.object[: e.start].count(b"\n") + 1
    return f"line {line}: not UTF-8 text (byte {e.object[e.start]:#04x})"
