"""Calling a task's reward on a batch of completions, with errors that name the sample."""

from __future__ import annotations

import math

import torch

from emapg.errors import EmapgError
from emapg.tasks.base import Example, Task


class RewardError(EmapgError, RuntimeError):
    """A reward function failed or returned a non-number, for a named sample."""


def score_completions(task: Task, completions: list[str], examples: list[Example], n: int,
                      evaluation: bool = False, truncated: torch.Tensor | None = None) -> torch.Tensor:
    """Rewards [len(completions)] for completions grouped n per example (example i // n).

    evaluation: score with the task's ``eval_reward`` (the correctness alone, without shaping terms
    such as a format bonus) instead of its training ``reward``. truncated: [len(completions)] bools, the
    responses that ran out of tokens: they score 0 where the task says so (``Task.zero_truncated``: the
    paper's math grader, as rLLM's engine does).
    """
    fn = task.eval_reward if evaluation else task.reward
    out = []
    for i, completion in enumerate(completions):
        ex = examples[i // n]
        try:
            value = float(fn(completion, ex))
        except Exception as e:  # the user's reward code: report which sample broke it
            raise RewardError(
                f"reward of task {task.name!r} raised {type(e).__name__}: {e} "
                f"(sample {i}: example {ex.id!r}, response {i % n}, completion {completion[:200]!r})"
            ) from e
        if not math.isfinite(value):
            raise RewardError(f"reward of task {task.name!r} returned {value} for sample {i} (example {ex.id!r})")
        out.append(value)
    rewards = torch.tensor(out, dtype=torch.float32)
    if truncated is not None and getattr(task, "zero_truncated", False):
        rewards[truncated.bool().cpu()] = 0.0
    return rewards
