"""What a task is: data, a prompt format, a reward, and (for tool tasks) an episode's budgets and a retriever."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


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
