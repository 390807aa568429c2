"""A task of your own, without editing emapg: "count down from N", rewarded when the response lists the
numbers N, N-1, ..., 1 in order. List this file in a config's ``plugins`` and name the task:

    emapg train --config smoke plugins=[examples/countdown_plugin.py] task=countdown "task_args={start: 5}"

(``task_args={...}`` replaces the recipe's arithmetic arguments; ``task_args.start=5`` would add to them.)

Every process of the run (torchrun, ``emapg compare``) imports the file before the config is checked, so
``task``, ``task_args`` and anything else it registers (an estimator, an advantage, a retriever, a rollout
backend: see docs/ARCHITECTURE.md "Where to add things") are checked like the built-in ones.
"""

from __future__ import annotations

import random
import re

from emapg.config import at_least
from emapg.tasks import register_task
from emapg.tasks.base import Example, Task


class Countdown(Task):
    """Args: start (the largest N of a problem), eval_size (held-out problems: N = 2 .. eval_size + 1, each
    once; training draws N uniformly from 2 .. start)."""

    name = "countdown"
    ARGS = {"start": at_least(2), "eval_size": at_least(1)}

    def __init__(self, start: int = 9, eval_size: int = 8):
        self.start, self.eval_size = start, eval_size

    @staticmethod
    def _example(n: int, prefix: str) -> Example:
        return Example(id=f"{prefix}-{n}", answer=list(range(n, 0, -1)),
                       messages=[{"role": "user", "content": f"Count down from {n} to 1, separated by spaces."}])

    def train_examples(self, rng: random.Random, n: int) -> list[Example]:
        return [self._example(rng.randint(2, self.start), "train") for _ in range(n)]

    def eval_examples(self, size: int) -> list[Example]:
        return [self._example(n, "eval") for n in range(2, 2 + min(size, self.eval_size))]

    def reward(self, completion: str, example: Example) -> float:
        # only digits are read from the model's text; nothing in it is executed
        return float([int(x) for x in re.findall(r"\d+", completion)][: len(example.answer)] == example.answer)


register_task("countdown", Countdown)
