"""Held-out evaluation: accuracy of a model on a task's examples."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from emapg.rollout import rollout_for_task
from emapg.scoring import score_completions
from emapg.tasks.base import Example, Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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
    progress: str | None = None,
    record: bool = False,
) -> dict[str, Any]:
    """Mean reward over ``examples`` x ``samples`` (avg@n: pass@1 averaged over n samples).

    Returns {'accuracy' (= avg@n), 'pass@k' for k = 1, 2, 4, ... <= n, 'mean_length', 'num'}.
    A reward >= 1 counts as correct for pass@k. Greedy decoding uses one sample per example.
    ``progress``: a label for a progress bar over the problems (on stderr), or None for none.
    ``record``: also return 'records', one {id, prompt, answer, completion, reward} per sample (the
    transcripts behind the number; an agent's completion includes the environment's information blocks).
    """
    from tqdm.auto import tqdm

    n = 1 if greedy else samples
    total, length, count = 0.0, 0.0, 0
    correct: list[int] = []
    stats: dict[str, float] = {}
    records: list[dict[str, Any]] = []
    # Batches of similar prompt length waste less compute on left padding (order does not matter here).
    examples = sorted(examples, key=lambda ex: sum(len(m["content"]) for m in ex.messages))
    bar = tqdm(total=len(examples), desc=progress, unit="problem", leave=False, disable=progress is None)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = rollout_for_task(model, tokenizer, task, chunk, n=n, temperature=temperature, top_p=top_p,
                                 max_new_tokens=max_new_tokens, greedy=greedy)
        rewards = score_completions(task, batch.completions, chunk, n, evaluation=True)
        total += float(rewards.sum())
        correct += (rewards >= 1.0).view(-1, n).sum(1).tolist()
        if record:
            records += [{"id": ex.id, "prompt": ex.messages[-1]["content"], "answer": ex.answer,
                         "completion": batch.completions[i * n + j], "reward": float(rewards[i * n + j])}
                        for i, ex in enumerate(chunk) for j in range(n)]
        length += float(batch.response_mask.sum())
        count += len(batch.completions)
        for key, v in batch.stats.items():
            stats[key] = stats.get(key, 0.0) + float(v.sum())
        bar.update(len(chunk))
    bar.close()
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    out = {"accuracy": total / max(count, 1), "mean_length": length / max(count, 1), "num": count, "samples": n}
    out.update({f"{key}_mean": v / max(count, 1) for key, v in stats.items()})  # e.g. searches per episode
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1)
    if record:
        out["records"] = records
    return out
