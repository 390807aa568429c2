"""What a valid config is: the tables derived from the schema's declarations, and the checks that read them.

Nothing here names a field by hand: :data:`RULES` (a rule per field), :data:`CONSISTENCY` (the rules across
fields), :func:`replay_safe`, :data:`EVAL_OPTIONS` and :data:`TRL_KEYWORDS` are read off the fields'
``setting(...)`` in :mod:`emapg.config.schema`. :func:`validate` runs them once when a config loads; what
consumes a loaded config trusts it. Code that takes the same settings from elsewhere (``emapg eval``'s options,
the TRL plug-in's keyword arguments) runs them through the same table with :func:`check_fields`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from emapg.backends import BACKENDS
from emapg.config.schema import TrainConfig, mini_batch_prompts
from emapg.errors import ConfigError
from emapg.settings import Rule, across_rules, all_of, declared, rule_problems

_FIELDS = declared(TrainConfig)

RULES: dict[str, Rule] = {name: f.metadata["rule"] for name, f in _FIELDS.items() if f.metadata.get("rule")}
"""Each field's own rule, by dotted name; a field without one takes any value of its type."""

CONSISTENCY: list[tuple[str, Callable[[TrainConfig], bool], Callable[[TrainConfig], str]]] = across_rules(TrainConfig)
"""Rules across fields: (the field the error names, whether the config is valid, the message)."""

EVAL_OPTIONS: dict[str, str] = {name: f.metadata["option"] for name, f in _FIELDS.items() if f.metadata.get("option")}
"""The ``emapg eval`` option that sets each field it shares with a config (checked by the field's rule)."""

TRL_KEYWORDS: dict[str, str] = {f.metadata["trl"]: name for name, f in _FIELDS.items() if f.metadata.get("trl")}
"""``EMAPGTrainer``'s keyword arguments that are config fields: keyword -> field."""


def replay_safe(name: str) -> bool:
    """Whether a resume may change this field (a dotted name, or a key inside a mapping field such as
    ``eval.transfer.ops``) without changing what the resumed steps replay."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        f = _FIELDS.get(".".join(parts[:i]))
        if f is not None:
            return bool(f.metadata.get("replay_safe"))
    return False


def check_fields(values: dict[str, Any], names: dict[str, str] | None = None) -> None:
    """Check settings by the table: ``{"algo.eta": 0.9, ...}``; one ConfigError naming every bad field, or
    the option it came from (``names``: ``{"eval.samples": "--samples"}``). The config loader checks every
    field this way; ``emapg eval`` checks its options and the TRL plug-in its keyword arguments."""
    problems = rule_problems(RULES, values, names)
    if problems:
        raise all_of(problems)


def check_options(cfg: TrainConfig, names: dict[str, str]) -> None:
    """A command's options that set config fields (``names``: field -> option, e.g. :data:`EVAL_OPTIONS`), read
    from ``cfg``: each by its field's rule, then by the rules across fields blamed on it; one ConfigError, every
    problem named by its option."""
    problems = rule_problems(RULES, {n: value_of(cfg, n) for n in names if n in RULES}, names)
    if not problems:  # the rules across fields assume each field's own
        problems = [f"{names[n]}: {message(cfg)}" for n, ok, message in CONSISTENCY if n in names and not ok(cfg)]
    if problems:
        raise all_of(problems)


def value_of(cfg: Any, name: str) -> Any:
    """The value of a dotted field name (``algo.eta``) in a config."""
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


TaskCheck = Callable[[str, dict[str, Any]], list[str]]
"""A task's check of its ``task_args``, ``check(task, task_args) -> problems`` (:func:`emapg.tasks.task_args_problems`,
given by the caller: the tasks build on this module, not the other way round)."""


def validate(cfg: TrainConfig, task_check: TaskCheck | None = None) -> None:
    """Check every field by :data:`RULES`, then :data:`CONSISTENCY`, and the task's ``task_args`` by
    ``task_check`` (before any model or data loads); raise one ConfigError naming every field wrong."""
    try:
        check_fields({name: value_of(cfg, name) for name in RULES})  # first: the rules across fields assume these
    except ConfigError as e:
        raise all_of(e.problems + args_problems(cfg, task_check)) from None
    problems = [f"{name}: {message(cfg)}" for name, ok, message in CONSISTENCY if not ok(cfg)]
    problems += args_problems(cfg, task_check)
    if problems:
        raise all_of(problems)


def args_problems(cfg: TrainConfig, task_check: TaskCheck | None) -> list[str]:
    """What ``task_check`` finds wrong in ``task_args`` (none given: nothing, the task checks them when it is
    built), and the backend's own check of ``rollout.backend_args`` (its declared settings)."""
    problems = []
    if isinstance(cfg.task_args, dict) and task_check is not None:
        problems += task_check(cfg.task, cfg.task_args)
    if cfg.rollout.backend in BACKENDS and isinstance(cfg.rollout.backend_args, dict):
        try:
            BACKENDS[cfg.rollout.backend].settings_of(cfg.rollout.backend_args)
        except ConfigError as e:
            problems += e.problems
    return problems


def check_world(cfg: TrainConfig, world: int) -> None:
    """The batch must split into whole prompt groups and whole micro-batches on each of ``world`` processes;
    offload needs the shards of 2+ processes."""
    mini = mini_batch_prompts(cfg)
    if cfg.offload and world < 2:
        raise ConfigError("offload: true needs FSDP2 shards: run under torchrun with 2 or more processes "
                          f"(this run has {world}); one process keeps its model on its device")
    if cfg.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: {cfg.prompts_per_step} does not split over {world} processes")
    if mini % world:
        raise ConfigError(f"mini_batch_prompts: {mini} does not split over {world} processes")
    if not cfg.micro_batch_tokens and (mini // world) % cfg.micro_batch_prompts:
        raise ConfigError(f"micro_batch_prompts: {cfg.micro_batch_prompts} does not divide the per-process "
                          f"mini-batch ({mini} prompts over {world} processes)")
