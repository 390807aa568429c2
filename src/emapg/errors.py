"""The error a user can fix by changing what they typed (a config field, an override, a command's option, a
spec). It lives apart from the config's schema so that code which only raises it (the retrieval server, the
rollout backends) does not import torch and the whole config to do so; ``emapg.config`` re-exports it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A user-fixable problem in a config file or an override; ``problems`` lists each one (a config with
    several wrong fields is reported once, all of them in one message)."""

    def __init__(self, message: str, problems: list[str] | None = None, partial: Any = None):
        super().__init__(message)
        self.problems = problems or [message]
        self.partial = partial  # what was built from the valid fields (the rest at their defaults), or None
