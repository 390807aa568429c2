"""The learning rate's schedule: its multiplier at each optimizer step (a warmup by optimizer steps, or verl's by
training steps), the rate a training step starts at, and a checkpoint's schedule restored at the config's rate."""

from __future__ import annotations

import torch

from emapg.config import TrainConfig


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
