"""Rollouts: single-turn sampling (hf.py) or multi-turn tool episodes (agent.py), chosen by the task."""

from __future__ import annotations

from torch import nn

from emapg.rollout.batch import RolloutBatch
from emapg.tasks.base import Example


def rollout_for_task(model: nn.Module, tokenizer, task, examples: list[Example], **kwargs) -> RolloutBatch:
    """A task with an ``agent`` budget (and a ``retriever``) gets multi-turn episodes; others one turn.

    kwargs: n, temperature, top_p, k, greedy, and max_new_tokens (single-turn only: an episode's
    budgets are the task's).
    """
    if getattr(task, "agent", None) is not None:
        from emapg.rollout.agent import rollout_model

        kwargs.pop("max_new_tokens", None)
        return rollout_model(model, tokenizer, examples, task.retriever, config=task.agent, **kwargs)
    from emapg.rollout.hf import generate

    return generate(model, tokenizer, examples, **kwargs)
