"""How every step of a run is cut, settled once when the run is assembled, and what its learning rate is.

``StepPlan``: how a step's batch is cut and which passes it runs; the step reads it and derives none of it from
the config again. ``step_micro_batches``: this process's share of a step as mini-batches (one optimizer step each)
of micro-batches (one forward and backward each, gradients accumulating), by prompts (``micro_batch_prompts``:
whole groups of responses) or packed by tokens (``micro_batch_tokens``: verl's dynamic batch size,
``ppo_max_token_len_per_gpu``). The cut changes memory, never the gradient: the loss of a mini-batch is normalised
by its global counts, whatever its micro-batches (tests/test_micro_batches.py). Packing keeps the rows in order (a
prompt's rows that land together share its pass) and makes, on every process, as many micro-batches as the process
that needs the most: under FSDP2 each is a sequence of collectives that all ranks must make alike. That one
all-reduce is the only impure line here. The learning rate: its multiplier at each optimizer step (a warmup by
optimizer steps, or verl's by training steps), the rate a training step starts at, and a checkpoint's schedule
restored at the config's rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from emapg import algo
from emapg.config import TrainConfig, mini_batch_prompts, recomputes_old
from emapg.models import distributed
from emapg.rollout import response_budget
from emapg.rollout.batch import RolloutBatch
from emapg.tasks.base import Task


@dataclass(frozen=True)
class StepPlan:
    """world: processes. mini_prompts: prompts per optimizer step, over all processes; rank_mini_prompts: this
    process's share of them. micro_prompts / micro_tokens: how a mini-batch is cut (by prompts, or packed by
    tokens when micro_tokens > 0: :func:`step_micro_batches`). optimizer_steps: per training step (PPO epochs x
    mini-batches). recompute_old: pi_old is the trainer's own (another engine sampled, or asked); old_pass:
    pi_old needs a pass of its own (:func:`emapg.algo.needs_old_pass`). max_response: the most tokens a response
    can hold (an agent's whole episode), what seq-mean-token-sum-norm divides by."""

    world: int
    mini_prompts: int
    rank_mini_prompts: int
    micro_prompts: int
    micro_tokens: int
    optimizer_steps: int
    recompute_old: bool
    old_pass: bool
    max_response: int


def step_plan(cfg: TrainConfig, world: int, task: Task) -> StepPlan:
    """The plan of ``cfg``'s steps on ``world`` processes (``check_world`` has accepted the split)."""
    mini = mini_batch_prompts(cfg)
    recompute = recomputes_old(cfg)
    return StepPlan(world=world, mini_prompts=mini, rank_mini_prompts=mini // world,
                    micro_prompts=cfg.micro_batch_prompts, micro_tokens=cfg.micro_batch_tokens,
                    optimizer_steps=cfg.algo.ppo_epochs * (cfg.prompts_per_step // mini), recompute_old=recompute,
                    old_pass=algo.needs_old_pass(cfg.algo, cfg.rollout.top_p, recompute),
                    max_response=response_budget(task, cfg.rollout.max_new_tokens))


def step_micro_batches(batch: RolloutBatch, mini_prompts: int, micro_prompts: int,
                       micro_tokens: int = 0) -> list[list[RolloutBatch]]:
    """This process's rows of a step as mini-batches of ``mini_prompts`` prompts, each cut into micro-batches
    of ``micro_prompts`` prompts, or, with ``micro_tokens`` > 0, packed by tokens (:func:`cut_into`)."""
    if not micro_tokens:  # micro_prompts divides mini_prompts (config.check_world)
        mbs, per = batch.micro_batches(micro_prompts), mini_prompts // micro_prompts
        return [mbs[i : i + per] for i in range(0, len(mbs), per)]
    minis = [slice(s, s + mini_prompts) for s in range(0, batch.num_prompts, mini_prompts)]
    tokens = row_tokens(batch)
    rows = [batch.rows(m) for m in minis]
    fewest = [len(greedy_cuts(tokens[r], micro_tokens)) - 1 for r in rows]
    counts = [int(c) for c in distributed.all_reduce(fewest, op="max")]  # every rank makes as many
    out = []
    for r, parts in zip(rows, counts, strict=True):
        cuts = cut_into(tokens[r], parts, micro_tokens)
        out.append([batch.row_batch(slice(r.start + a, r.start + b)) for a, b in pairwise(cuts)])
    return out


def row_tokens(batch: RolloutBatch) -> list[int]:
    """Each row's tokens, as verl counts them against its budget: its prompt's and its response's up to the
    last token that counts (tool output before it is context the pass runs too)."""
    return (batch.per_row(batch.prompt_mask.sum(1)) + batch.extent()).tolist()


def greedy_cuts(tokens: list[int], budget: int) -> list[int]:
    """Boundaries [0, ..., len(tokens)] of the fewest consecutive runs of rows that each count at most
    ``budget`` tokens (a row over it alone): the greedy cut, which is the fewest for consecutive runs."""
    cuts, total = [0], 0
    for i, t in enumerate(tokens):
        if i > cuts[-1] and total + t > budget:
            cuts.append(i)
            total = 0
        total += t
    return [*cuts, len(tokens)]


def cut_into(tokens: list[int], parts: int, budget: int) -> list[int]:
    """Boundaries of exactly ``parts`` consecutive non-empty runs (1 <= parts <= rows, and at least the fewest
    :func:`greedy_cuts` makes): the greedy cut, whose runs are within ``budget``, then the run with the most
    tokens split where its two halves' tokens are closest, until there are ``parts``; every run stays within
    ``budget`` (or is one row)."""
    cuts = greedy_cuts(tokens, budget)
    if not len(cuts) - 1 <= parts <= len(tokens):
        raise ValueError(f"{parts} runs of {len(tokens)} rows: the greedy cut needs {len(cuts) - 1}")
    while len(cuts) - 1 < parts:
        _, a, b = max((sum(tokens[a:b]), a, b) for a, b in pairwise(cuts) if b - a > 1)
        middle = min(range(a + 1, b), key=lambda m: (abs(sum(tokens[a:m]) - sum(tokens[m:b])), m))
        cuts = sorted([*cuts, middle])
    return cuts


def lr_factor(cfg: TrainConfig, optimizer_steps: int, steps_done: int) -> float:
    """The learning rate's multiplier for the next optimizer step, after ``optimizer_steps`` of them and
    ``steps_done`` whole training steps: ``warmup_steps`` counts optimizer steps; ``warmup_ratio`` counts
    training steps from 0, as verl's constant schedule with warmup does (lr 0 on the first step)."""
    if cfg.warmup_steps:
        return min(1.0, (optimizer_steps + 1) / cfg.warmup_steps)
    if cfg.warmup_ratio:
        return min(1.0, steps_done / max(1, int(cfg.warmup_ratio * cfg.steps)))
    return 1.0


def schedule_step_lr(optimizer: torch.optim.Optimizer, scheduler) -> float:
    """Set the learning rate for a new training step (a schedule by training step changes it here; one by
    optimizer step is unchanged); returns it."""
    for group, lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    return optimizer.param_groups[0]["lr"]


def restore_schedule(scheduler, state: dict, lr: float) -> None:
    """A checkpoint's schedule (how far it went) at the config's learning rate (a later stage may change it)."""
    scheduler.load_state_dict(state)
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
