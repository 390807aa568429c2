"""Rollouts: single-turn sampling (hf.py) or multi-turn tool episodes (agent.py), chosen by the task."""

from __future__ import annotations

from torch import nn

from emapg.rollout.agent import agent_rollout, rollout_model
from emapg.rollout.batch import RolloutBatch
from emapg.rollout.hf import generate
from emapg.rollout.sampling import SamplingSpec
from emapg.tags import STOPS
from emapg.tasks.base import Example, Task


def rollout_for_task(model: nn.Module, tokenizer, task: Task, examples: list[Example], spec: SamplingSpec, *,
                     engine=None, seed: int | None = None, prefix_sharing: bool = True,
                     reuse_cache: bool = True, max_rows: int | None = None) -> RolloutBatch:
    """``spec.n`` responses per example, sampled as ``spec`` says. A task with an ``agent`` budget (and
    a ``retriever``) gets multi-turn episodes (whose budgets are the task's, not spec.max_new_tokens);
    others one turn.

    ``engine``: a :class:`~emapg.rollout.vllm_backend.VLLMRollout` holding the model's weights samples
    instead of ``model`` (``seed`` seeds its requests); None = our decode loop over ``model``, where
    ``prefix_sharing`` runs each prompt once for its n samples and ``reuse_cache`` keeps an episode's
    key/value cache between turns (:func:`emapg.rollout.agent.rollout_model`), and ``max_rows`` bounds
    the rows decoding at once (None: all). The engine caches prefixes and bounds its batch by itself.
    """
    if engine is not None:
        return _engine_rollout(engine, model, tokenizer, task, examples, spec, seed)
    if task.agent is not None:
        return rollout_model(model, tokenizer, examples, task.retriever, spec, config=task.agent,
                             reuse_cache=reuse_cache, prefix_sharing=prefix_sharing, max_rows=max_rows)
    return generate(model, tokenizer, examples, spec, prefix_sharing=prefix_sharing, max_rows=max_rows)


def response_budget(task: Task, max_new_tokens: int) -> int:
    """The most tokens a response can hold: an episode's whole budget (model turns and retrieved
    information) for agent tasks, ``max_new_tokens`` for one turn (seq-mean-token-sum-norm divides by it)."""
    return task.agent.max_total_tokens if task.agent is not None else max_new_tokens


def _engine_rollout(engine, model: nn.Module, tokenizer, task: Task, examples: list[Example], spec: SamplingSpec,
                    seed: int | None) -> RolloutBatch:
    device = next(model.parameters()).device
    if task.agent is not None:
        sampler = engine.sampler(spec, stop=STOPS, seed=seed)
        batch = agent_rollout(sampler, tokenizer, examples, task.retriever, spec, config=task.agent, eos=engine.eos)
        return batch.to(device)
    return engine.generate(examples, spec, seed=seed, device=device)
