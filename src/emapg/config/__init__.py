"""The training configuration, in three parts: what a field is (:mod:`~emapg.config.schema`, each field declared
once with its rule), what a valid config is (:mod:`~emapg.config.rules`, tables derived from the schema) and how
a config is read (:mod:`~emapg.config.loading`: YAML, ``extends:``, overrides, plugins). How a field is declared
and a mapping read into the dataclasses is :mod:`emapg.settings` (below the config: a backend's settings and a
task's arguments use it too). Everything is importable from here: ``from emapg.config import load_config``."""

from emapg.config.loading import (
    COMPARE_MARKER,
    MOVED,
    RUN_MARKER,
    SHIPPED_RECIPES,
    TRUST_FLAG,
    apply_override,
    apply_overrides,
    import_plugins,
    load_config,
    merged_task_args,
    run_folder_of,
    save_config,
    to_dict,
)
from emapg.config.rules import (
    CONSISTENCY,
    EVAL_OPTIONS,
    RULES,
    TRL_KEYWORDS,
    check_fields,
    check_options,
    check_world,
    replay_safe,
    validate,
    value_of,
)
from emapg.config.schema import (
    DTYPE_NAMES,
    AlgoConfig,
    EvalConfig,
    LoraConfig,
    RolloutConfig,
    TrainConfig,
    mini_batch_prompts,
    recomputes_old,
)
from emapg.errors import ConfigError
from emapg.settings import Rule, above, across_rules, at_least, one_of, rule_problems, setting, typed, within

__all__ = [
    "AlgoConfig", "CONSISTENCY", "ConfigError", "DTYPE_NAMES", "EVAL_OPTIONS", "EvalConfig", "LoraConfig", "MOVED",
    "COMPARE_MARKER", "RULES", "RUN_MARKER", "RolloutConfig", "Rule", "SHIPPED_RECIPES", "TRL_KEYWORDS",
    "TRUST_FLAG", "TrainConfig", "above", "across_rules", "apply_override", "apply_overrides", "at_least",
    "check_fields", "check_options", "check_world", "import_plugins", "load_config", "merged_task_args",
    "mini_batch_prompts", "run_folder_of", "one_of", "recomputes_old", "replay_safe", "rule_problems", "save_config",
    "setting", "to_dict", "typed", "validate", "value_of", "within"]
