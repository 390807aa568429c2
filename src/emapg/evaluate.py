"""Held-out evaluation: accuracy of a model on a task's examples."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from emapg.rollout.hf import generate
from emapg.scoring import score_completions
from emapg.tasks.base import Example, Task


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokenizer,
    task: Task,
    examples: list[Example],
    *,
    max_new_tokens: int = 32,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    samples: int = 1,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Mean reward over ``examples`` x ``samples`` (pass@1 averaged over samples when sampling).

    Returns {'accuracy', 'mean_length', 'num'}; accuracy = mean reward (rewards are 0/1 for the
    built-in tasks). Greedy decoding uses one sample per example.
    """
    n = 1 if greedy else samples
    total, length, count = 0.0, 0.0, 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = generate(model, tokenizer, chunk, n=n, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, greedy=greedy)
        rewards = score_completions(task, batch.completions, chunk, n)
        total += float(rewards.sum())
        length += float(batch.response_mask.sum())
        count += len(batch.completions)
    return {"accuracy": total / max(count, 1), "mean_length": length / max(count, 1), "num": count}
