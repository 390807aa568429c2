"""What every step of a run does, settled once when the run is assembled: how its batch is cut and which passes
it runs. The step reads these; it derives none of them from the config again."""

from __future__ import annotations

from dataclasses import dataclass

from emapg import algo
from emapg.config import TrainConfig, mini_batch_prompts, recomputes_old
from emapg.rollout import response_budget
from emapg.tasks.base import Task


@dataclass(frozen=True)
class StepPlan:
    """world: processes. mini_prompts: prompts per optimizer step, over all processes; rank_mini_prompts: this
    process's share of them. micro_prompts / micro_tokens: how a mini-batch is cut (by prompts, or packed by
    tokens when micro_tokens > 0: :mod:`emapg.run.micro_batches`). optimizer_steps: per training step (PPO epochs x
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
