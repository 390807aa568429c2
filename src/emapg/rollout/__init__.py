"""Rollouts: single-turn sampling (hf.py) or multi-turn tool episodes (agent.py), chosen by the task, by an engine.

An engine is what a rollout backend (:mod:`emapg.backends`) gives a run: ``sync(model, version)`` (the weights to
sample with), ``rollout(task, examples, spec, *, seed, device)`` (a :class:`RolloutBatch`), ``after_rollout()``
and ``close()``. The ``hf`` backend's is :class:`DecodeLoop`, emapg's own decode loop over the model being
trained; an engine that samples tokens itself (vLLM's, a user's) builds its ``rollout`` with
:func:`sampled_rollout` from its ``generate`` (one turn) and ``sampler`` (tool episodes). The training step
has this one path whatever the backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from emapg.models.distributed import gathered
from emapg.rollout.agent import agent_rollout, rollout_model
from emapg.rollout.hf import generate
from emapg.rollout.sampling import RolloutBatch, SamplingSpec
from emapg.tags import STOPS
from emapg.tasks.base import Example, Task


def local_rollout(model: nn.Module, tokenizer, task: Task, examples: list[Example], spec: SamplingSpec, *,
                  prefix_sharing: bool = True, reuse_cache: bool = True, max_rows: int | None = None) -> RolloutBatch:
    """``spec.n`` responses per example from emapg's decode loop over ``model``: multi-turn episodes for a task
    with an ``agent`` budget (and a ``retriever``; the budgets are the task's, not spec.max_new_tokens), else one
    turn. ``prefix_sharing`` runs each prompt once for its n samples, ``reuse_cache`` keeps an episode's
    key/value cache between turns (:func:`emapg.rollout.agent.rollout_model`), ``max_rows`` bounds the rows
    decoding at once (None: all)."""
    if task.agent is not None:
        return rollout_model(model, tokenizer, examples, task.retriever, spec, config=task.agent,
                             reuse_cache=reuse_cache, prefix_sharing=prefix_sharing, max_rows=max_rows)
    return generate(model, tokenizer, examples, spec, prefix_sharing=prefix_sharing, max_rows=max_rows)


def sampled_rollout(engine: Any, tokenizer, task: Task, examples: list[Example], spec: SamplingSpec, *,
                    seed: int | None, device: Any) -> RolloutBatch:
    """An engine's rollout from its tokens: ``engine.generate`` for one turn, ``engine.sampler`` (and
    ``engine.eos``) for a tool task's episodes; ``seed`` seeds its requests; the batch on ``device``."""
    if task.agent is not None:
        sampler = engine.sampler(spec, stop=STOPS, seed=seed)
        batch = agent_rollout(sampler, tokenizer, examples, task.retriever, spec, config=task.agent, eos=engine.eos)
        return batch.to(device)
    return engine.generate(examples, spec, seed=seed, device=device)


class DecodeLoop:
    """The ``hf`` backend's engine: emapg's decode loop (:func:`local_rollout`) over the model being trained. It
    holds no weights of its own: ``sync`` points it at the model to sample from, which a rollout gathers whole
    (FSDP2 shards) and runs under the run's ``autocast``; it samples from torch's generator, which the step seeds,
    so ``seed`` is not used."""

    def __init__(self, tokenizer, *, prefix_sharing: bool = True, reuse_cache: bool = True,
                 max_rows: int | None = None, autocast: Callable[[], Any] = contextlib.nullcontext):
        self.tokenizer, self.model = tokenizer, None
        self.prefix_sharing, self.reuse_cache, self.max_rows, self.autocast = prefix_sharing, reuse_cache, max_rows, \
            autocast

    def sync(self, model: nn.Module, version: Any) -> bool:
        self.model = model
        return False  # nothing copied

    def rollout(self, task: Task, examples: list[Example], spec: SamplingSpec, *, seed: int | None = None,
                device: Any = None) -> RolloutBatch:
        with gathered(self.model) as model, self.autocast():
            return local_rollout(model, self.tokenizer, task, examples, spec, prefix_sharing=self.prefix_sharing,
                                 reuse_cache=self.reuse_cache, max_rows=self.max_rows)

    def after_rollout(self) -> None:
        pass

    def close(self) -> None:
        self.model = None


def rollout_for_task(model: nn.Module, tokenizer, task: Task, examples: list[Example], spec: SamplingSpec, *,
                     engine=None, seed: int | None = None, prefix_sharing: bool = True,
                     reuse_cache: bool = True, max_rows: int | None = None) -> RolloutBatch:
    """An evaluation's rollout: ``engine`` (one holding ``model``'s weights, e.g. vLLM's; ``seed`` seeds its
    requests) samples, or, with None, the decode loop over ``model`` (:func:`local_rollout`)."""
    if engine is not None:
        return engine.rollout(task, examples, spec, seed=seed, device=next(model.parameters()).device)
    return local_rollout(model, tokenizer, task, examples, spec, prefix_sharing=prefix_sharing,
                         reuse_cache=reuse_cache, max_rows=max_rows)


def response_budget(task: Task, max_new_tokens: int) -> int:
    """The most tokens a response can hold: an episode's whole budget (model turns and retrieved
    information) for agent tasks, ``max_new_tokens`` for one turn (seq-mean-token-sum-norm divides by it)."""
    return task.agent.max_total_tokens if task.agent is not None else max_new_tokens
