"""The memory plan: what one device holds in each phase of a training step, from the model's config.json
and the run config alone (no weights are read), and the largest settings that fit.

Phases (each on top of what stays resident: the policy's, anchor's and teacher's weights, the optimizer's
state, and vLLM's share while it is awake):

* ``rollout``: the HF decode loop's key/value cache (``rollout.max_rows`` rows at a time, or every row),
  one step's ``[rows, vocab]`` buffers, the per-token records, and under FSDP the gathered weights.
  With the vLLM backend the engine's share replaces it.
* ``reference``: a no-grad pass of a micro-batch (anchor, pi_old, teacher): one layer's activations at a
  time and the head's chunk of logits.
* ``update``: a micro-batch's saved activations (every layer, or only each layer's input under gradient
  checkpointing, plus one layer recomputed), the head's chunk of logits, the gradients.

The activations are measured, not guessed: :func:`activation_cost` runs the model's own decoder layer at its
real widths on the CPU, at a few small lengths, and counts the bytes autograd saves (per token, per token
squared where the attention keeps its weights, per layer fixed such as autocast's weight copies). The rest
is arithmetic over the config. ``docs/BENCHMARKS.md`` ("The memory plan against measured peaks") compares
the plan with measured peaks; ``emapg train`` runs it at the start on a GPU and refuses a run that cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STEP_BYTES = 32  # bytes per row x vocab entry alive in one decoding step (fp32 logits, softmax, float64 CDF)
TOP_P_BYTES = 24  # and more under top-p (the sort, its order, the cut's mask)
HEAD_CHUNK_COPIES = 3  # [chunk, vocab] fp32 blocks alive at once in the head's pass (logits, softmax, gradient)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, read from its config (the model built on the meta device)."""

    params: int
    layer_params: int
    largest_param: int
    vocab: int
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    config: Any = field(compare=False, repr=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value elements one token adds to the cache, all layers (multiply by the dtype's bytes)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def model_config(name: str, trust_remote_code: bool = False, field: str = "model"):
    """The transformers config of a built-in name or a model folder (its config.json; no weights)."""
    from emapg.models import zoo as models

    if name in models.BUILTIN and name != "smollm2-135m":
        with torch.device("meta"):
            model, _ = models.load_model(name)
        return model.config
    from transformers import AutoConfig

    path = models.smollm2_folder() if name == "smollm2-135m" else name
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # no folder, no config.json, a Hub name not cached while offline
        from emapg.errors import ConfigError

        why = str(e).strip().splitlines()[0]
        raise ConfigError(f"{field}: {name!r} is neither a built-in name ({', '.join(models.BUILTIN)}) nor a model "
                          f"folder with a config.json, nor a Hub name this machine has ({why})") from None


def shape_of(config) -> ModelShape:
    """The counts of a config: the model built on the meta device (no memory, no weights). A config whose sizes
    are not whole numbers >= 1 is a ConfigError naming the field."""
    from transformers import AutoModelForCausalLM

    from emapg.errors import ConfigError

    text = getattr(config, "text_config", None) or config
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        value = getattr(text, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"model: its config.json's {name} is {value!r}, expected a whole number >= 1")

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from emapg.models.lm import decoder_and_head

    decoder, head = decoder_and_head(model)
    layer = decoder.layers[0]
    heads = text.num_attention_heads
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()), layer_params=sum(p.numel() for p in layer.parameters()),
        largest_param=max(p.numel() for p in model.parameters()),
        vocab=head.weight.shape[0], hidden=text.hidden_size, layers=len(decoder.layers),
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, config=config)


@dataclass(frozen=True)
class ActivationCost:
    """Bytes autograd keeps per decoder layer for a row of T tokens: ``per_token * T + per_token_sq * T**2``,
    plus ``per_layer`` whatever the length (autocast's copies of the weights)."""

    per_token: float
    per_token_sq: float
    per_layer: float

    def layer_bytes(self, rows: int, tokens: int) -> float:
        return self.per_layer + rows * (self.per_token * tokens + self.per_token_sq * tokens**2)


def _layers_model(config, layers: int, dtype: str, checkpointing: bool) -> nn.Module:
    """A copy of the model with ``layers`` layers and a 256-token vocabulary, its weights and buffers zeros
    (their values change no byte autograd saves), in ``dtype``, in the flags of a pass with gradients."""
    import warnings

    from transformers import AutoModelForCausalLM

    from emapg.models.lm import set_pass_mode
    from emapg.models.zoo import DTYPES

    cfg = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": layers, "vocab_size": 256,
                                      "layer_types": None, "use_cache": False, "bos_token_id": None,
                                      "eos_token_id": None, "pad_token_id": None})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and t.numel():
                t.zero_()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    set_pass_mode(model, grad=True)
    return model


def _saved_bytes(model: nn.Module, tokens: int, autocast: bool) -> int:
    """Bytes autograd saves (parameters not counted, each storage once) in a forward of one row of
    ``tokens`` tokens (its first column padded, so the attention takes a mask as in emapg's passes)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 256, (1, tokens))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
    return sum(seen.values())


_COSTS: dict[tuple, ActivationCost] = {}


CALIBRATION_BYTES = 2 * GIB  # the most a full-width calibration may build (its 1- and 2-layer copies' weights)


def activation_cost(shape: ModelShape, dtype: str, mixed_precision: str | None,
                    checkpointing: bool) -> ActivationCost:
    """What one decoder layer of this model saves for its backward pass, measured on the CPU at 16, 32 and 64
    tokens (a layer of the real widths: two layers' bytes minus one layer's) and fitted exactly. A layer too wide
    to build within :data:`CALIBRATION_BYTES` (a 70B model's) is measured at three narrower widths (hidden,
    intermediate and head counts divided alike, the head size kept) and scaled: per token affine in the width,
    per layer quadratic (autocast's weight copies), so the fit is exact for a layer whose widths scale together
    (tested against the full width). Cached per config and settings."""
    key = (shape.config.to_json_string(use_diff=False), dtype, mixed_precision, checkpointing)
    if key not in _COSTS:
        full = 3 * shape.layer_params * DTYPE_BYTES[dtype]  # the 1- and 2-layer copies together
        divisors = _width_divisors(shape.config) if full > CALIBRATION_BYTES else []
        if len(divisors) < 3:
            _COSTS[key] = _measured_cost(shape.config, dtype, mixed_precision, checkpointing)
        else:
            # the three largest reductions that fit, as widths w = 1/d of the full one
            fits = [d for d in divisors if full / d**2 <= CALIBRATION_BYTES][:3]
            fits = fits if len(fits) == 3 else divisors[-3:]
            costs = [(1 / d, _measured_cost(_narrowed(shape.config, d), dtype, mixed_precision, checkpointing))
                     for d in fits]
            _COSTS[key] = ActivationCost(per_token=_extrapolate([(w, c.per_token) for w, c in costs], 1),
                                         per_token_sq=_extrapolate([(w, c.per_token_sq) for w, c in costs], 1),
                                         per_layer=_extrapolate([(w, c.per_layer) for w, c in costs], 2))
    return _COSTS[key]


def _measured_cost(config, dtype: str, mixed_precision: str | None, checkpointing: bool) -> ActivationCost:
    lengths, autocast = (16, 32, 64), mixed_precision == "bf16"
    one, two = (_layers_model(config, n, dtype, checkpointing) for n in (1, 2))
    per = [_saved_bytes(two, t, autocast) - _saved_bytes(one, t, autocast) for t in lengths]
    (t0, t1, t2), (y0, y1, y2) = lengths, per  # per(t) = c + a t + b t^2, solved from the three lengths
    b = ((y2 - y1) / (t2 - t1) - (y1 - y0) / (t1 - t0)) / (t2 - t0)
    a = (y1 - y0) / (t1 - t0) - b * (t1 + t0)
    c = y0 - a * t0 - b * t0**2
    return ActivationCost(per_token=max(a, 0.0), per_token_sq=max(b, 0.0), per_layer=max(c, 0.0))


def _width_divisors(config) -> list[int]:
    """Divisors d > 1 by which hidden, intermediate, head and key/value-head counts all divide (head size kept),
    smallest first: the narrower copies of a layer a calibration can measure."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    widths = (text.hidden_size, text.intermediate_size, heads, kv)
    return [d for d in range(2, kv + 1) if all(w % d == 0 for w in widths)]


def _narrowed(config, d: int):
    """The config with every width divided by ``d`` (hidden, intermediate, heads, key/value heads; head size
    kept, so attention's per-head shapes are the real ones)."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    return config.__class__.from_dict({**config.to_dict(), "hidden_size": text.hidden_size // d,
                                       "intermediate_size": text.intermediate_size // d,
                                       "num_attention_heads": heads // d, "num_key_value_heads": kv // d,
                                       "head_dim": head_dim})


def _extrapolate(points: list[tuple[float, float]], degree: int) -> float:
    """The polynomial of ``degree`` in the width through the measured points (least squares), at width 1."""
    import numpy as np

    xs, ys = zip(*points, strict=True)
    return max(float(np.polyval(np.polyfit(xs, ys, degree), 1.0)), 0.0)


@dataclass
class Phase:
    """One phase of a step: its parts in bytes (name -> bytes), on top of what stays resident."""

    name: str
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class Plan:
    """Per-device bytes: what stays resident, each phase's own parts, and the peak (resident + the largest phase)."""

    resident: dict[str, float]
    phases: list[Phase]
    host: dict[str, float]
    notes: list[str]

    @property
    def peak(self) -> float:
        return sum(self.resident.values()) + max((p.total for p in self.phases), default=0.0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p.total).name if self.phases else "-"


def plan(cfg: Any, shape: ModelShape, *, world: int = 1, prompt_tokens: int = 512,
         response_tokens: int | None = None, gpu_memory: float | None = None, teacher: ModelShape | None = None,
         device: str = "cuda") -> Plan:
    """The per-device memory plan of ``cfg`` (a TrainConfig) on ``world`` devices, for prompts of up to
    ``prompt_tokens`` tokens and responses of up to ``response_tokens`` (default rollout.max_new_tokens; an
    agent episode's whole budget for agent tasks), the policy's layers costing what :func:`activation_cost`
    measures. ``gpu_memory`` (bytes) sizes vLLM's share when the backend is vllm. ``device``: cuda (AdamW's
    multi-tensor step: one parameter-sized temporary) or cpu (one tensor at a time)."""
    shard = 1.0 / world if world > 1 else 1.0
    pb = DTYPE_BYTES[cfg.dtype]
    cb = 2 if cfg.mixed_precision == "bf16" else pb
    on_device = 0.0 if cfg.offload else 1.0
    trainable = shape.params if cfg.lora.r == 0 else _lora_params(shape, cfg)
    n, budget = cfg.rollout.n, response_tokens or cfg.rollout.max_new_tokens
    p = _resident(cfg, shape, teacher, trainable, shard)
    rows_step = cfg.prompts_per_step // world * n
    if cfg.rollout.backend == "vllm":
        share = cfg.rollout.vllm_gpu_memory * (gpu_memory or 0.0)
        if device == "cpu":  # the CPU engine holds no share of a device: its weights and its own KV cache
            share = shape.params * 4 + (cfg.rollout.vllm_kv_cache_gib or 0.0) * GIB
            if cfg.rollout.vllm_kv_cache_gib is None:
                p.notes.append("the CPU vLLM engine's KV cache is sized from the run: set rollout.vllm_kv_cache_gib "
                               "to count it")
        if cfg.rollout.vllm_sleep and device != "cpu":  # freed during the update (no sleep mode on the CPU)
            p.phases.append(Phase("rollout", {"vLLM engine (weights and cache)": share}))
        else:
            p.resident["vLLM engine, awake through the update"] = share
        if gpu_memory is None and device != "cpu":
            p.notes.append("vLLM's share is a fraction of the GPU: give --gpu-memory to count it")
    else:
        rows = min(cfg.rollout.max_rows or rows_step, rows_step)
        step = STEP_BYTES + (TOP_P_BYTES if cfg.rollout.top_p < 1 else 0)
        parts = {"key/value cache": rows * (prompt_tokens + budget) * shape.kv_bytes_per_token * cb,
                 "decoding step buffers": rows * shape.vocab * step,
                 "per-token records": rows_step * budget * (20 + 8 * cfg.algo.k)}
        if world > 1:
            parts["gathered weights (FSDP)"] = shape.params * cb
        p.phases.append(Phase("rollout", parts))
    mb_rows, tokens = cfg.micro_batch_prompts * n, prompt_tokens + budget
    head = {"head's logits chunk": min(cfg.chunk_size, mb_rows * budget) * shape.vocab * 4 * HEAD_CHUNK_COPIES}
    layer_gather = {"gathered layers (FSDP)": 2 * shape.layer_params * cb} if world > 1 else {}
    cost = lambda ck: activation_cost(shape, cfg.dtype, cfg.mixed_precision, ck)  # noqa: E731
    plain = cost(False).layer_bytes(mb_rows, tokens)
    nograd = mb_rows * tokens * _nograd_bytes(shape, cb)
    p.phases.append(Phase("reference", {"one layer's activations (no grad)": nograd, **head, **layer_gather}))
    saved = cost(True).layer_bytes(mb_rows, tokens) if cfg.gradient_checkpointing else plain
    update = {"saved activations": shape.layers * saved, **head, **layer_gather,
              "gradients": trainable * pb * shard * on_device}
    if cfg.gradient_checkpointing:
        update["one layer recomputed"] = plain
    p.phases.append(Phase("update", update))
    if not cfg.offload:
        temp = trainable * pb * shard if device == "cuda" else 2 * min(trainable, shape.largest_param) * pb
        p.phases.append(Phase("optimizer step", {"gradients": trainable * pb * shard, "AdamW temporaries": temp}))
    return p


def _resident(cfg: Any, shape: ModelShape, teacher: ModelShape | None, trainable: int, shard: float) -> Plan:
    """A plan holding only what stays resident between phases (on the device, or on the host with offload):
    the policy's, the anchor's and a teacher's weights, and AdamW's two moments."""
    pb = DTYPE_BYTES[cfg.dtype]
    weights = {"policy weights": shape.params * pb * shard}
    if cfg.lora.r == 0:
        weights["anchor weights"] = shape.params * pb * shard + (shape.params * 4 * shard if pb < 4 else 0)
    else:
        weights["anchor adapters"] = trainable * 4
    if cfg.log_kl_to_init and cfg.algo.eta < 1.0 and cfg.lora.r == 0:
        weights["initial policy (kl_to_init)"] = shape.params * pb * shard
    if teacher is not None:
        weights["teacher weights"] = teacher.params * DTYPE_BYTES[cfg.algo.teacher_dtype or cfg.dtype] * shard
    weights["optimizer state (AdamW)"] = 2 * trainable * pb * shard
    if cfg.offload:
        return Plan(resident={}, phases=[], host={**weights, "gradients": trainable * pb * shard}, notes=[])
    return Plan(resident=weights, phases=[], host={}, notes=[])


def _nograd_bytes(shape: ModelShape, cb: int) -> float:
    """Bytes per token alive inside one layer of a pass without gradients: the MLP's three [tokens, I] blocks,
    the attention's queries, keys, values and output, and the fp32 residual stream twice."""
    text = getattr(shape.config, "text_config", None) or shape.config
    attention = (2 * text.num_attention_heads + 2 * shape.kv_heads) * shape.head_dim
    return (3 * text.intermediate_size + attention) * cb + 2 * shape.hidden * 4


_LORA: dict[tuple, int] = {}


def _lora_params(shape: ModelShape, cfg: Any) -> int:
    """Trainable parameters of the LoRA adapters ``cfg.lora`` asks for (PEFT on the meta model; cached, as
    :func:`largest_fitting` plans many times)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    key = (shape.config.to_json_string(use_diff=False), cfg.lora.r, str(cfg.lora.target_modules))
    if key not in _LORA:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape.config)
            peft = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                    target_modules=cfg.lora.target_modules))
        _LORA[key] = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    return _LORA[key]


def run_plan(cfg: Any, config, task, tokenizer, *, world: int = 1, device: str = "cuda",
             gpu_memory: float | None = None) -> Plan:
    """The plan of a run as ``emapg train`` checks it: the model's ``config``, prompts as long as the task's
    longest (:func:`emapg.rollout.prompts.longest_prompt`), responses as long as its budget (an agent episode's whole
    budget), a teacher's config read from ``algo.teacher``."""
    from emapg.rollout import response_budget
    from emapg.rollout.prompts import longest_prompt

    teacher = shape_of(model_config(cfg.algo.teacher, field="algo.teacher")) if cfg.algo.teacher else None
    return plan(cfg, shape_of(config), world=world, prompt_tokens=longest_prompt(task, tokenizer),
                response_tokens=response_budget(task, cfg.rollout.max_new_tokens), gpu_memory=gpu_memory,
                teacher=teacher, device=device)


def render(p: Plan, capacity: float | None = None) -> str:
    """The plan as a table in GiB: resident parts, each phase's parts, the peak (and the device's capacity)."""
    lines = ["| part | GiB |", "|---|---|"]
    lines += [f"| {k} | {v / GIB:.2f} |" for k, v in p.resident.items() if v]
    for ph in p.phases:
        lines.append(f"| **{ph.name}** (on top) | {ph.total / GIB:.2f} |")
        lines += [f"| · {k} | {v / GIB:.2f} |" for k, v in ph.parts.items() if v]
    lines.append(f"| **peak ({p.peak_phase})** | **{p.peak / GIB:.2f}** |")
    if capacity:
        lines.append(f"| device memory | {capacity / GIB:.2f} |")
    if p.host:
        lines.append(f"| host memory (offload) | {sum(p.host.values()) / GIB:.2f} |")
    return "\n".join(lines + [f"\n{note}" for note in p.notes])


def largest_fitting(cfg: Any, shape: ModelShape, capacity: float, **kw) -> dict[str, Any]:
    """The largest ``rollout.max_rows`` (hf backend) and ``micro_batch_prompts`` that fit in ``capacity``
    bytes, each tried with the other as configured (None: none fits)."""
    import dataclasses

    out: dict[str, Any] = {}
    if cfg.rollout.backend == "hf":
        rows_step = cfg.prompts_per_step // kw.get("world", 1) * cfg.rollout.n
        best = None
        for rows in sorted({cfg.rollout.n * 2**i for i in range(0, 20)} | {rows_step}):
            if rows > rows_step:
                break
            trial = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_rows=rows))
            if _phase(plan(trial, shape, **kw), "rollout") <= capacity:
                best = rows
        out["rollout.max_rows"] = best
    best, share = None, (cfg.mini_batch_prompts or cfg.prompts_per_step) // kw.get("world", 1)
    for mb in (m for m in range(1, share + 1) if share % m == 0):  # whole micro-batches per process
        trial = dataclasses.replace(cfg, micro_batch_prompts=mb)
        if _phase(plan(trial, shape, **kw), "update") <= capacity:
            best = mb
    out["micro_batch_prompts"] = best
    return out


def _phase(p: Plan, name: str) -> float:
    return sum(p.resident.values()) + next((ph.total for ph in p.phases if ph.name == name), 0.0)


def too_big(p: Plan, capacity: float, cfg: Any) -> str | None:
    """None when the plan fits ``capacity``, else a one-line reason naming, for each phase that does not fit,
    the settings to try."""
    if p.peak <= capacity:
        return None
    over = {ph.name for ph in p.phases if _phase(p, ph.name) > capacity}
    offload = [] if cfg.offload else ["offload=true (torchrun, 2+ processes)"]
    fixes = []
    if sum(p.resident.values()) > capacity:  # the weights and optimizer state alone: no phase setting helps
        fixes += ["lora.r > 0 (adapters train, the anchor averages them)"] * (cfg.lora.r == 0) + offload
        offload = []
    if "rollout" in over and cfg.rollout.backend == "hf":
        fixes.append("rollout.max_rows (fewer rows decoding at once)")
    if "rollout" in over and cfg.rollout.backend == "vllm":
        fixes.append(f"a lower rollout.vllm_gpu_memory (the engine takes {cfg.rollout.vllm_gpu_memory:g} of the "
                     "device while it is awake)")
    if over & {"update", "reference"}:
        if not cfg.gradient_checkpointing and "update" in over:
            fixes.append("gradient_checkpointing=true")
        if cfg.micro_batch_prompts > 1:
            fixes.append("a smaller micro_batch_prompts")
    fixes += [*offload, "more devices"]
    return (f"the memory plan needs {p.peak / GIB:.1f} GiB per device at its peak ({p.peak_phase}), more than the "
            f"device's {capacity / GIB:.1f} GiB: try {', '.join(fixes)} (`emapg plan` prints every "
            "part; memory_check=false runs it anyway)")


def report(cfg: Any, *, gpus: int, gpu_memory_gb: float, prompt_tokens: int, response_tokens: int | None = None,
           device: str = "cuda") -> str:
    """``emapg plan``'s text: the plan of ``cfg`` on ``gpus`` devices (``device``: cuda, or cpu for processes
    sharing a host) of ``gpu_memory_gb`` GiB each, whether it fits, and the largest row bound and micro-batch
    that fit. ``response_tokens``: default an agent task's ``task_args.max_total_tokens`` when it sets one, else
    rollout.max_new_tokens."""
    import dataclasses

    from emapg.config import ConfigError, check_world

    response_tokens = response_tokens or cfg.task_args.get("max_total_tokens") or cfg.rollout.max_new_tokens
    refused = None
    try:  # what `emapg train` refuses on this many processes, the plan does not call a fit
        check_world(cfg, gpus)
    except ConfigError as e:
        refused = str(e)
        if cfg.offload and gpus < 2:  # what one device would run instead: the plan of that
            cfg = dataclasses.replace(cfg, offload=False)
    shape = shape_of(model_config(cfg.model))
    teacher = shape_of(model_config(cfg.algo.teacher, field="algo.teacher")) if cfg.algo.teacher else None
    capacity = gpu_memory_gb * GIB
    kw = dict(world=gpus, prompt_tokens=prompt_tokens, response_tokens=response_tokens, gpu_memory=capacity,
              teacher=teacher, device=device)
    p = plan(cfg, shape, **kw)
    head = (f"{cfg.model}: {shape.params / 1e9:.2f}B parameters, {shape.layers} layers, vocabulary {shape.vocab}; "
            f"{gpus} device(s) of {gpu_memory_gb:g} GiB; prompts up to {prompt_tokens} tokens, responses up to "
            f"{response_tokens}; per device:\n")
    verdict = too_big(p, capacity, cfg) or f"fits: peak {p.peak / GIB:.1f} of {capacity / GIB:.1f} GiB"
    if refused:
        alt = " (the plan above is with offload=false, what one device runs)" if "offload" in refused else ""
        verdict = (f"does not run on {gpus} device(s): `emapg train` refuses it: {refused}{alt}; with that: "
                   f"{verdict}")
    best = largest_fitting(cfg, shape, capacity, **kw)
    sizes = ", ".join(f"{k}={v}" for k, v in best.items() if v is not None) or "none"
    return f"{head}\n{render(p, capacity)}\n\n{verdict}\nlargest that fit (each with the rest as set): {sizes}"
