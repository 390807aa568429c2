"""What a task is: data, a prompt format, and a reward."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Example:
    """One problem. ``messages`` is a chat (list of {role, content}); ``answer`` is what the reward
    checks against; ``meta`` carries any extra columns to the reward function."""

    id: str
    messages: list[dict[str, str]]
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """A task provides training prompts, a fixed held-out set, and a reward in [0, 1]."""

    name: str

    def train_examples(self, rng: random.Random, n: int) -> list[Example]:
        """``n`` training examples drawn with ``rng`` (deterministic given its state)."""
        ...

    def eval_examples(self, size: int) -> list[Example]:
        """The first ``size`` examples of the fixed held-out set (disjoint from training)."""
        ...

    def reward(self, completion: str, example: Example) -> float:
        """Score one completion. Must not execute model output."""
        ...

    # Optional: ``prompt_pools() -> list[list[Example]]``, every example a task hands out (lists the
    # caller may edit in place), for tasks that read user files whose prompts may not fit the model.
