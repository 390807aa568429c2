"""What a task is (data, a prompt format, a reward, and for tool tasks an episode's budgets and a retriever), the
order a run sees its training prompts in, and its reward called on a batch of completions.

The order (``data_order``):

* ``random``: each step draws its prompts with replacement, seeded by (seed, step).
* ``epochs``: the training set walked in shuffled epochs without replacement, as verl's dataloader walks it
  (a ``RandomSampler`` over a generator seeded with the run's seed, batches of ``prompts_per_step``, the last
  incomplete batch of an epoch dropped): epoch e is the (2e + 1)-th ``torch.randperm`` of that generator (the
  sampler draws two per epoch, the second cut to nothing). Step s's
  prompts are a function of (seed, s) alone, so a run resumed mid-epoch continues the epoch exactly.

Scoring: a reward that fails or returns a non-number is a :class:`RewardError` naming the sample.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from emapg.errors import ConfigError, EmapgError


@dataclass
class Example:
    """One problem. ``messages`` is a chat (list of {role, content}); ``answer`` is what the reward
    checks against; ``meta`` carries any extra columns to the reward function."""

    id: str
    messages: list[dict[str, str]]
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentConfig:
    """Budgets of one tool episode (the Search-R1 protocol, :mod:`emapg.rollout.agent`)."""

    max_turns: int = 4
    """Turns that may search (at most this many searches); the turn after them ends the episode whatever it
    does (Search-R1's final rollout): at most ``max_turns + 1`` model turns."""
    passages: int = 3
    """Passages per search."""
    max_turn_tokens: int = 128
    """New model tokens per turn."""
    max_total_tokens: int = 1024
    """All response tokens of an episode: model turns plus retrieved information."""
    max_info_tokens: int = 384
    """Tokens of one <information> block (longer ones are cut)."""
    force_answer: bool = False
    """After the last allowed search, open the model's next turn with "<answer>" (environment text,
    mask 0): every episode that uses its searches then ends with an answer attempt."""
    turn_prefix: str = ""
    """Text the environment writes (mask 0) to open every turn that follows an information block while
    searches remain, e.g. "<search>": the model then only has to write the next query."""
    invalid_action: str = ""
    """Text the environment writes (mask 0) after a turn that neither searches nor answers (ended by EOS or its
    token budget), and the episode goes on while turns remain; an EOS that ended such a turn is dropped from the
    episode (Search-R1 decodes without special tokens). Empty: such a turn ends the episode."""



class Task:
    """A task provides training prompts, a fixed held-out set, and a reward in [0, 1].

    Subclasses implement the first three methods; the rest has defaults for single-turn tasks.
    Everything the training and evaluation code asks of a task is declared here.
    """

    name: str = "task"
    agent: AgentConfig | None = None
    """The budgets of a multi-turn tool episode; None = one model turn per response."""
    zero_truncated: bool = False
    """A response that ran out of tokens scores 0 whatever it holds (rLLM's engine, under the paper's grader)."""
    ARGS: ClassVar[dict[str, tuple[Callable[[Any], bool], Any]]] = {}
    """The rules of the task's keyword arguments (its ``task_args``), written with the config's rule builders
    (``emapg.config.at_least``, ``one_of``, ``within``): :func:`emapg.tasks.make_task` checks them, with
    the types ``__init__`` declares, before the task is built, every wrong entry in one message. Rules
    across arguments stay in ``__init__``."""

    def train_examples(self, rng: random.Random, n: int) -> list[Example]:
        """``n`` training examples drawn with ``rng`` (deterministic given its state)."""
        raise NotImplementedError

    def eval_examples(self, size: int) -> list[Example]:
        """The first ``size`` examples of the fixed held-out set (disjoint from training)."""
        raise NotImplementedError

    def train_pool(self) -> list[Example] | None:
        """The whole training set when the task has a fixed one (a data file), for ``data_order: epochs``;
        None when it draws or generates its examples."""
        return None

    def reward(self, completion: str, example: Example) -> float:
        """Score one completion for training. Must not execute model output."""
        raise NotImplementedError

    def eval_reward(self, completion: str, example: Example) -> float:
        """Correctness for held-out accuracy, without training-only shaping bonuses (default: the reward)."""
        return self.reward(completion, example)

    @property
    def retriever(self) -> Any:
        """What answers an agent's searches (``search(queries, topk) -> [[Passage]]``); None without tools."""
        return None

    def prompt_pools(self) -> list[list[Example]]:
        """Every example the task hands out, as lists the caller may edit in place (cut a prompt
        that does not fit the model), for tasks that read user files. Generated tasks return []."""
        return []


ORDERS = ("random", "epochs")


def _batches_per_epoch(size: int, per_step: int) -> int:
    batches = size // per_step
    if batches == 0:
        raise ConfigError(f"data_order: epochs needs at least prompts_per_step ({per_step}) training examples, "
                         f"the task has {size}")
    return batches


def epoch_indices(size: int, per_step: int, seed: int, step: int) -> list[int]:
    """The training-set indices of step ``step`` (1-based) in shuffled epochs of a set of ``size`` examples."""
    epoch, batch = divmod(step - 1, _batches_per_epoch(size, per_step))
    g = torch.Generator().manual_seed(seed)
    for _ in range(2 * epoch):  # the sampler's generator runs on: each epoch draws two permutations (its order,
        torch.randperm(size, generator=g)  # then one cut to num_samples % n = 0 rows)
    order = torch.randperm(size, generator=g)
    return order[batch * per_step : (batch + 1) * per_step].tolist()


def _pool(task: Task) -> list[Example]:
    pool = task.train_pool()
    if pool is None:
        raise ConfigError(f"data_order: epochs needs a task with a fixed training set; {task.name!r} draws its "
                          "examples")
    return pool


def check_order(task: Task, order: str, per_step: int) -> None:
    """Before the first step: ``epochs`` needs a fixed training set of at least one step's prompts."""
    if order == "epochs":
        _batches_per_epoch(len(_pool(task)), per_step)


def defined_in(cls: type) -> str:
    """Where a class (a plugin's task) is defined, as a user wrote it: ``Echo in my_plugin.py``."""
    try:
        return f"{cls.__qualname__} in {Path(inspect.getfile(cls)).name}"
    except (TypeError, OSError):
        return f"{cls.__module__}.{cls.__qualname__}"


def draw_examples(task: Task, rng: random.Random, n: int) -> list[Example]:
    """``task.train_examples(rng, n)``, checked: a task (a plugin's) that returns anything but a list of ``n``
    Examples is named in one line."""
    return _checked_examples(task, "train_examples", task.train_examples(rng, n), n, exact=True)


def held_out_examples(task: Task, size: int) -> list[Example]:
    """``task.eval_examples(size)``, checked: a task (a plugin's) that returns anything but a list of at most
    ``size`` Examples is named in one line."""
    return _checked_examples(task, "eval_examples", task.eval_examples(size), size, exact=False)


def _checked_examples(task: Task, method: str, got: Any, n: int, exact: bool) -> list[Example]:
    """``got``, what ``task.method`` returned, when it is a list of ``n`` Examples (``exact``) or at most ``n``;
    else an EmapgError naming the task's class, its file and what it returned."""
    if not (isinstance(got, list) and (len(got) == n if exact else len(got) <= n)
            and all(isinstance(e, Example) for e in got)):
        what = (f"{len(got)} items of {', '.join(sorted({type(e).__name__ for e in got}))}"
                if isinstance(got, list) and got else "an empty list" if isinstance(got, list) else type(got).__name__)
        raise EmapgError(f"task {defined_in(type(task))}: {method} returned {what}, expected a list of "
                         f"{'' if exact else 'at most '}{n} Example")
    for e in got:  # a chat: the prompt's template and the sampler read each message's role and content
        if not (isinstance(e.messages, list) and e.messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in e.messages)):
            raise EmapgError(f"task {defined_in(type(task))}: {method} returned Example {e.id!r} whose messages are "
                             f"{e.messages!r:.80}, expected a list of {{role, content}} texts")
    return got


def training_prompts(task: Task, order: str, seed: int, step: int, n: int, step_seed: int) -> list[Example]:
    """The ``n`` training examples of step ``step``: drawn with ``random.Random(step_seed)``, or the step's batch
    of the shuffled epochs."""
    if order == "random":
        return draw_examples(task, random.Random(step_seed), n)
    pool = _pool(task)
    return [pool[i] for i in epoch_indices(len(pool), n, seed, step)]


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
