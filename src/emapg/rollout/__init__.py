"""Rollouts: single-turn sampling (hf.py) or multi-turn tool episodes (agent.py), chosen by the task."""

from __future__ import annotations

from torch import nn

from emapg.rollout.agent import agent_rollout, rollout_model
from emapg.rollout.batch import RolloutBatch
from emapg.rollout.hf import generate
from emapg.tags import STOPS
from emapg.tasks.base import Example, Task


def rollout_for_task(model: nn.Module, tokenizer, task: Task, examples: list[Example], engine=None,
                     seed: int | None = None, **kwargs) -> RolloutBatch:
    """A task with an ``agent`` budget (and a ``retriever``) gets multi-turn episodes; others one turn.

    kwargs: n, temperature, top_p, k, greedy, prefix_sharing, max_new_tokens (single-turn only: an episode's
    budgets are the task's) and reuse_cache (episodes only: see :func:`emapg.rollout.agent.rollout_model`).
    ``engine``: a :class:`~emapg.rollout.vllm_backend.VLLMRollout` holding
    the model's weights samples instead of ``model`` (``seed`` seeds its requests); None = HF generate.
    """
    if engine is not None:
        return _engine_rollout(engine, model, tokenizer, task, examples, seed, **kwargs)
    reuse_cache = kwargs.pop("reuse_cache", True)
    if task.agent is not None:
        kwargs.pop("max_new_tokens", None)
        return rollout_model(model, tokenizer, examples, task.retriever, config=task.agent, reuse_cache=reuse_cache,
                             **kwargs)
    return generate(model, tokenizer, examples, **kwargs)


def response_budget(task: Task, max_new_tokens: int) -> int:
    """The most tokens a response can hold: an episode's whole budget (model turns and retrieved
    information) for agent tasks, ``max_new_tokens`` for one turn (seq-mean-token-sum-norm divides by it)."""
    return task.agent.max_total_tokens if task.agent is not None else max_new_tokens


def _engine_rollout(engine, model: nn.Module, tokenizer, task: Task, examples: list[Example], seed: int | None,
                    **kwargs) -> RolloutBatch:
    device = next(model.parameters()).device
    for key in ("prefix_sharing", "reuse_cache"):  # the engine caches prefixes by itself
        kwargs.pop(key, None)
    if task.agent is not None:
        kwargs.pop("max_new_tokens", None)
        n, k = kwargs.pop("n", 1), kwargs.get("k", 0)
        sampler = engine.sampler(stop=STOPS, seed=seed, **kwargs)
        batch = agent_rollout(sampler, tokenizer, examples, task.retriever, n=n, k=k, config=task.agent,
                              eos=engine.eos)
        return batch.to(device)
    return engine.generate(examples, seed=seed, device=device, **kwargs)
