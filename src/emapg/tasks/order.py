"""The order in which a run sees its training prompts (``data_order``).

* ``random``: each step draws its prompts with replacement, seeded by (seed, step).
* ``epochs``: the training set walked in shuffled epochs without replacement, as verl's dataloader walks it
  (a ``RandomSampler`` over a generator seeded with the run's seed, batches of ``prompts_per_step``, the last
  incomplete batch of an epoch dropped): epoch e is the (2e + 1)-th ``torch.randperm`` of that generator (the
  sampler draws two per epoch, the second cut to nothing). Step s's
  prompts are a function of (seed, s) alone, so a run resumed mid-epoch continues the epoch exactly.
"""

from __future__ import annotations

import random

import torch

from emapg.errors import ConfigError
from emapg.tasks.base import Example, Task

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


def training_prompts(task: Task, order: str, seed: int, step: int, n: int, step_seed: int) -> list[Example]:
    """The ``n`` training examples of step ``step``: drawn with ``random.Random(step_seed)``, or the step's batch
    of the shuffled epochs."""
    if order == "random":
        return task.train_examples(random.Random(step_seed), n)
    pool = _pool(task)
    return [pool[i] for i in epoch_indices(len(pool), n, seed, step)]
