"""The memory plan: what one device holds in each phase of a training step, from the model's config.json
and the run config alone (no weights are read), and the largest settings that fit.

Phases (each on top of what stays resident: the policy's, anchor's and teacher's weights, the optimizer's
state, and vLLM's share while it is awake):

* ``rollout``: the HF decode loop's key/value cache (``rollout.max_rows`` rows at a time, or every row),
  one step's ``[rows, vocab]`` buffers, the per-token records, and under FSDP the gathered weights.
  With the vLLM backend the engine's share replaces it.
* ``reference``: a no-grad pass of a micro-batch (anchor, pi_old, teacher): with prefix sharing the prompts'
  keys and values repeated per row, one layer's activations at a time, the attention mask, the head's chunk.
* ``update``: a micro-batch's saved activations (every layer, or only each layer's input under gradient
  checkpointing, plus one layer recomputed), the attention mask, the head's chunk of logits and its backward's
  buffers, the gradients; then the optimizer step.
* ``evaluation``: the held-out decode loop (64 problems at a time, each with its samples); a distillation run's
  teacher answers them once, and its teacher KL holds both models' float64 log-probs, 256 positions at a time.
* ``export``: rank 0 gathers the policy and the anchor whole (on the host; the device when planning a CPU).

What a pass saves is measured, not guessed: :func:`activation_cost` runs emapg's own pass
(:func:`emapg.models.forward.response_hidden`, prefix-shared) through copies of the model with one and two
layers of the real widths, on the CPU, at a few small micro-batches, counts the bytes autograd saves, and
fits each term (:class:`ActivationCost`). The rest is arithmetic over the config. ``docs/BENCHMARKS.md`` ("The
memory plan against measured peaks") compares the plan, phase by phase, with measured peaks on shapes held
apart from those the terms were developed on; ``emapg train`` checks it at the start and refuses a run that
cannot fit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from emapg.backends import BACKENDS
from emapg.config import ConfigError, check_world, mini_batch_prompts
from emapg.models import zoo as models
from emapg.models.distributed import native_bf16
from emapg.models.forward import response_hidden
from emapg.models.lm import decoder_and_head, set_pass_mode
from emapg.rollout import response_budget
from emapg.rollout.prompts import longest_prompt
from emapg.rollout.sampling import RolloutBatch

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STEP_BYTES = 32  # bytes per row x vocab entry alive in one decoding step (fp32 logits, softmax, float64 CDF)
TOP_P_BYTES = 24  # and more under top-p (the sort, its order, the cut's mask)
HEAD_CHUNK_COPIES = 3  # [chunk, vocab] fp32 blocks alive at once in the head's backward (logits, softmax, gradient)
HEAD_NOGRAD_COPIES = 2  # and in a pass without gradients (logits, the log-sum-exp's or top-k's temporary)


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
    if name in models.BUILTIN and name != "smollm2-135m":
        with torch.device("meta"):
            model, _ = models.load_model(name)
        return model.config


    path = models.smollm2_folder() if name == "smollm2-135m" else name

    raw = Path(path) / "config.json"
    if raw.is_file():  # read it ourselves first: a config.json that is not a JSON object is one line, not a TypeError
        try:
            data = json.loads(raw.read_bytes().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{field}: {raw} is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{field}: {raw} holds {json.dumps(data)[:40]}, not a JSON object of the model's sizes")
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
        # before transformers divides by them (heads 0: a crash); a size of another type is transformers' to name
        check_sizes({k: v for k, v in text.items() if isinstance(v, int) and not isinstance(v, bool)}, field)
        depth = text.get("num_hidden_layers")
        if isinstance(depth, int) and depth > MAX_LAYERS:  # transformers lists each layer's type: 10^9 took minutes
            raise ConfigError(f"{field}: {raw} gives num_hidden_layers {depth:,}; emapg plans at most "
                              f"{MAX_LAYERS:,} layers (the deepest published models have a few hundred)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        if raw.is_file():  # a missing size takes the class's default, which fits no checkpoint of this model
            data = json.loads(raw.read_text())
            if "vocab_size" not in data and "vocab_size" not in (data.get("text_config") or {}):
                raise ConfigError(f"{field}: {raw} has no vocab_size")
        return config
    except ConfigError:
        raise
    except Exception as e:
        if type(e).__name__.startswith("StrictDataclass"):  # a config.json field of the wrong type
            cause = " ".join(str(e).split())
            raise ConfigError(f"{field}: {path}'s config.json: {cause}") from None
        if not isinstance(e, OSError | ValueError):
            raise
        # no folder, no config.json, a Hub name not cached while offline
        why = str(e).strip().splitlines()[0]
        raise ConfigError(f"{field}: {name!r} is neither a built-in name ({', '.join(models.BUILTIN)}) nor a model "
                          f"folder with a config.json, nor a Hub name this machine has ({why})") from None


SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
         "num_key_value_heads", "head_dim")
"""The sizes of a config.json that must be whole numbers >= 1 where given."""


def check_sizes(sizes: dict[str, Any], field: str = "model", required: tuple[str, ...] = ()) -> None:
    """A ConfigError naming the first of :data:`SIZES` given in ``sizes`` that is not a whole number >= 1, or
    missing where ``required``."""
    for name in SIZES:
        value = sizes.get(name)
        if value is None and name in required:
            raise ConfigError(f"{field}: its config.json has no {name}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{field}: its config.json's {name} is {value!r}, expected a whole number >= 1")


MAX_LAYERS = 100_000
"""The deepest model a plan takes from a config.json."""
MAX_BUILT_LAYERS = 512
"""Deeper than any real model: :func:`shape_of` builds two layers and counts the rest as their copies."""


def shape_of(config) -> ModelShape:
    """The counts of a config: the model built on the meta device (no memory, no weights). A config whose sizes
    are not whole numbers >= 1 is a ConfigError naming the field."""

    text = getattr(config, "text_config", None) or config
    check_sizes({name: getattr(text, name, None) for name in SIZES}, required=("vocab_size",))
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None)
    if kv is not None and heads % kv:
        raise ConfigError(f"model: its config.json's num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv})")
    if getattr(text, "head_dim", None) is None and text.hidden_size % heads:
        raise ConfigError(f"model: its config.json's hidden_size ({text.hidden_size}) does not split into "
                          f"num_attention_heads ({heads}) and it gives no head_dim")
    layers = text.num_hidden_layers
    # past any real model's depth, built with two layers and counted for all (building 10^9 took minutes and died)
    few = 2 if layers > MAX_BUILT_LAYERS and text is config else layers
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config if few == layers else config.__class__.from_dict(
                {**config.to_dict(), "num_hidden_layers": few, "layer_types": None}))
    except (RuntimeError, ValueError, TypeError, OverflowError) as e:  # sizes no model can have
        raise ConfigError(f"model: its config.json describes no model transformers can build "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None

    decoder, head = decoder_and_head(model)
    layer = decoder.layers[0]
    layer_params = sum(p.numel() for p in layer.parameters())
    heads = text.num_attention_heads
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()) + (layers - few) * layer_params, layer_params=layer_params,
        largest_param=max(p.numel() for p in model.parameters()),
        vocab=head.weight.shape[0], hidden=text.hidden_size, layers=layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, config=config)


@dataclass(frozen=True)
class ActivationCost:
    """Bytes autograd keeps for the backward pass of emapg's model pass (models/forward.py), per decoder layer
    and per pass. With prefix sharing a micro-batch's ``prompts`` prompts of P tokens run once each
    (``prompt_token * P + prompt_token_sq * P**2`` per prompt, per layer) and its ``rows`` responses of R tokens
    read those prompts' keys and values repeated per row (``token * R + prefix_token * P + query_key * R * (P + R)``
    per row, per layer); without sharing a row of T tokens costs ``token * T + query_key * T**2`` per layer.
    ``per_layer``: per layer whatever the lengths (autocast's weight copies); ``pass_token`` and
    ``pass_prompt_token``: per response (or plain) token and per prompt token, once a pass, not per layer (the
    embeddings' output, the final norm)."""

    token: float
    query_key: float
    per_layer: float
    prompt_token: float
    prompt_token_sq: float
    prefix_token: float
    pass_token: float
    pass_prompt_token: float
    checkpointed: bool = False

    def layer_bytes(self, rows: int, tokens: int) -> float:
        """One layer of the plain pass: ``rows`` rows of ``tokens`` tokens (checkpointed: its input alone, no
        weight copies; those come from the prompt pass, which the prefix-shared pass never checkpoints)."""
        fixed = 0.0 if self.checkpointed else self.per_layer
        return fixed + rows * (self.token * tokens + self.query_key * tokens**2)

    def pass_bytes(self, prompts: int, rows: int, prompt_tokens: int, response_tokens: int, sharing: bool) -> float:
        """What a pass keeps once, not per layer."""
        if not sharing:
            return self.pass_token * rows * (prompt_tokens + response_tokens)
        return self.pass_prompt_token * prompts * prompt_tokens + self.pass_token * rows * response_tokens

    def shared_layer_bytes(self, prompts: int, rows: int, prompt_tokens: int, response_tokens: int) -> float:
        """One layer of the prefix-shared pass: ``prompts`` prompts, ``rows`` responses."""
        p, r = prompt_tokens, response_tokens
        return (self.per_layer + prompts * (self.prompt_token * p + self.prompt_token_sq * p**2)
                + rows * (self.token * r + self.prefix_token * p + self.query_key * r * (p + r)))


# (prompts, samples each, prompt tokens, response tokens): the passes a calibration measures (8 points for the
# 6 per-layer and 3 per-pass terms, each term moved alone by some pair of points)
CALIBRATION_POINTS = ((1, 2, 16, 16), (1, 2, 32, 16), (1, 2, 16, 32), (2, 2, 16, 16), (1, 4, 16, 16),
                      (1, 2, 64, 32), (1, 2, 32, 64), (2, 3, 24, 40))

@dataclass(frozen=True)
class Calibration:
    """What a calibration builds the model's layers as: their dtype, autocast, checkpointing, LoRA adapters
    (``(r, alpha, target modules)``, or None)."""

    dtype: str
    mixed_precision: str | None
    checkpointing: bool
    lora: tuple | None = None


def _layers_model(config, layers: int, how: Calibration) -> nn.Module:
    """A copy of the model with ``layers`` layers and a 256-token vocabulary, its weights and buffers zeros
    (their values change no byte autograd saves), in the calibration's dtype and flags of a pass with gradients,
    with its LoRA adapters (the base frozen) when it has them."""



    cfg = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": layers, "vocab_size": 256,
                                      "layer_types": None, "use_cache": False, "bos_token_id": None,
                                      "eos_token_id": None, "pad_token_id": None})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=models.DTYPES[how.dtype])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and t.numel():
                t.zero_()
    if how.checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if how.lora is not None:

        r, alpha, targets = how.lora
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
    set_pass_mode(model, grad=True)
    return model


def _calibration_batch(prompts: int, n: int, prompt_tokens: int, response_tokens: int):
    """A micro-batch of ``prompts`` prompts (their first column padding, so the attention takes a mask as in a
    run) with ``n`` responses each of ``response_tokens`` inputs."""
    ids = torch.randint(2, 256, (prompts, prompt_tokens))
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    resp = torch.randint(2, 256, (prompts * n, response_tokens + 1))
    return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=torch.ones_like(resp),
                        samp_logp=torch.zeros(resp.shape), n=n)


def _saved_bytes(model: nn.Module, mb, autocast: bool, sharing: bool = True) -> int:
    """Bytes autograd saves (parameters not counted, each storage once) in emapg's pass of the micro-batch
    ``mb`` (:func:`emapg.models.forward.response_hidden`, prefix-shared or plain)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    kept: list[torch.Tensor] = []  # alive until the pass ends, so that no two saved storages share an address

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        kept.append(t)
        return None  # the graph keeps nothing: no backward runs, and a tensor saved by its own node would make a
        # cycle through its grad_fn that Python's collector cannot see (each calibration kept its copies alive)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        response_hidden(model, mb, prefix_sharing=sharing)
    kept.clear()
    return sum(seen.values())


_COSTS: dict[tuple, ActivationCost] = {}


CALIBRATION_BYTES = 2 * GIB  # the most a full-width calibration may build (its 1- and 2-layer copies' weights)
MEASURABLE_BYTES = 8 * GIB  # past this even the narrowest copy it could measure is refused, never allocated
PER_TOKEN_FIELDS = ("token", "query_key", "prompt_token", "prompt_token_sq", "prefix_token", "pass_token",
                    "pass_prompt_token")


def activation_cost(shape: ModelShape, how: Calibration) -> ActivationCost:
    """What this model's pass saves for its backward, measured on the CPU: the prefix-shared pass of small
    micro-batches (:data:`CALIBRATION_POINTS`) through copies of the model with one and two layers of the real
    widths (the difference is a layer, the rest the pass), each term fitted by least squares (exact: a test
    predicts a held-out pass to the byte). A layer too wide to build within :data:`CALIBRATION_BYTES` (a 70B
    model's) is measured at three narrower widths (hidden, intermediate and head counts divided alike, the head
    size kept) and scaled: per token affine in the width, per layer quadratic (autocast's weight copies), so the
    fit is exact for a layer whose widths scale together (tested against the full width). Cached per config and
    calibration."""
    key = (shape.config.to_json_string(use_diff=False), how)
    if key not in _COSTS:
        full = 3 * shape.layer_params * DTYPE_BYTES[how.dtype]  # the 1- and 2-layer copies together
        divisors = _width_divisors(shape.config) if full > CALIBRATION_BYTES else []
        smallest = full / divisors[-3] ** 2 if len(divisors) >= 3 else full  # the least this could build
        if smallest > MEASURABLE_BYTES:
            text = getattr(shape.config, "text_config", None) or shape.config

            raise ConfigError(f"model: a layer of this shape (hidden_size {text.hidden_size}, intermediate_size "
                              f"{text.intermediate_size}, {text.num_attention_heads} heads) holds "
                              f"{shape.layer_params * DTYPE_BYTES[how.dtype] / GIB:,.1f} GiB of weights, too wide to "
                              f"measure its activations within {MEASURABLE_BYTES / GIB:.0f} GiB, and its widths share "
                              "too few divisors to measure it narrower: emapg plan cannot plan it")
        if len(divisors) < 3:
            _COSTS[key] = _measurable(shape, how, smallest)
        else:
            # the three largest reductions that fit, as widths w = 1/d of the full one
            fits = [d for d in divisors if full / d**2 <= CALIBRATION_BYTES][:3]
            fits = fits if len(fits) == 3 else divisors[-3:]
            costs = [(1 / d, _measurable(shape, how, full / d**2, _narrowed(shape.config, d))) for d in fits]
            _COSTS[key] = ActivationCost(**{
                name: _extrapolate([(w, getattr(c, name)) for w, c in costs], 1 if name in PER_TOKEN_FIELDS else 2)
                for name in (*PER_TOKEN_FIELDS, "per_layer")}, checkpointed=how.checkpointing)
    return _COSTS[key]


def _measurable(shape: ModelShape, how: Calibration, weights: float, config=None) -> ActivationCost:
    """:func:`_measured_cost` of ``config`` (the model's own by default), whose copies hold ``weights`` bytes;
    memory this machine cannot give them is one line naming the shape, not the allocator's traceback."""
    try:
        return _measured_cost(shape.config if config is None else config, how)
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and "alloc" not in str(e):
            raise
        text = getattr(shape.config, "text_config", None) or shape.config
        raise ConfigError(f"model: a layer of this shape (hidden_size {text.hidden_size}, intermediate_size "
                          f"{text.intermediate_size}, {text.num_attention_heads} heads) is measured in copies holding "
                          f"{weights / GIB:,.1f} GiB of weights, more than this machine could allocate "
                          f"({_allocator_words(str(e))}): emapg plan cannot plan it here") from None


def _allocator_words(message: str) -> str:
    """The words of an allocator's error a user needs (torch's start with its source file and line)."""
    said = re.search(r"(can't allocate memory.*?bytes)", message)
    return said.group(1) if said else message.splitlines()[0][:160]


def _measured_cost(config, how: Calibration) -> ActivationCost:

    autocast = how.mixed_precision == "bf16"
    one, two = (_layers_model(config, n, how) for n in (1, 2))
    layer, per_pass, terms, pass_terms = [], [], [], []
    torch.manual_seed(0)
    for prompts, n, p, r in CALIBRATION_POINTS:
        mb = _calibration_batch(prompts, n, p, r)
        a, b = _saved_bytes(one, mb, autocast), _saved_bytes(two, mb, autocast)
        rows = prompts * n
        terms.append([1, prompts * p, prompts * p * p, rows * r, rows * p, rows * r * (p + r)])
        pass_terms.append([prompts * p, rows * r])
        layer.append(b - a)
        per_pass.append(2 * a - b)
    fit = np.linalg.lstsq(np.array(terms, float), np.array(layer, float), rcond=None)[0]
    pass_prompt_token, pass_token = np.linalg.lstsq(np.array(pass_terms, float), np.array(per_pass, float),
                                                    rcond=None)[0]
    per_layer, prompt_token, prompt_token_sq, token, prefix_token, query_key = (max(float(v), 0.0) for v in fit)
    return ActivationCost(token=token, query_key=query_key, per_layer=per_layer, prompt_token=prompt_token,
                          prompt_token_sq=prompt_token_sq, prefix_token=prefix_token,
                          pass_token=max(float(pass_token), 0.0),
                          pass_prompt_token=max(float(pass_prompt_token), 0.0), checkpointed=how.checkpointing)


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
    engine_fix: str | None = None  # the rollout engine's setting that shrinks it, as its backend names it

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
    agent episode's whole budget for agent tasks), the policy's pass costing what :func:`activation_cost`
    measures. ``gpu_memory`` (bytes) sizes vLLM's share when the backend is vllm. ``device``: cuda (AdamW's
    multi-tensor step: one parameter-sized temporary) or cpu (one tensor at a time)."""
    shard = 1.0 / world if world > 1 else 1.0
    pb = DTYPE_BYTES[cfg.dtype]
    trainable = shape.params if cfg.lora.r == 0 else _lora_params(shape, cfg)
    budget = response_tokens or cfg.rollout.max_new_tokens
    p = _resident(cfg, shape, teacher, trainable, shard)
    backend = BACKENDS[cfg.rollout.backend]
    engine = backend.for_run is not None and backend.for_eval is not None  # it evaluates too
    if backend.for_run is not None:
        _engine_share(cfg, shape, gpu_memory, device, p)
    else:
        rows_step = cfg.prompts_per_step // world * cfg.rollout.n
        p.phases.append(Phase("rollout", _decoding(cfg, shape, world, rows_step, prompt_tokens, budget)))
    p.phases += _pass_phases(cfg, shape, world, prompt_tokens, budget, trainable * pb * shard)
    if not cfg.offload:
        temp = trainable * pb * shard if device == "cuda" else 2 * min(trainable, shape.largest_param) * pb
        p.phases.append(Phase("optimizer step", {"gradients": trainable * pb * shard, "AdamW temporaries": temp}))
    p.phases += _eval_phases(cfg, shape, teacher, world, prompt_tokens, engine)
    if cfg.export and world > 1:  # rank 0 gathers the policy and the anchor (and a weight EMA of its own) whole
        own_ema = cfg.weight_ema is not None and cfg.algo.eta == 1.0  # and loads them into an unsharded model
        export = {"export (rank 0: policy and anchor" + (", weight EMA" if own_ema else "") +
                  " gathered, an unsharded model)": (3 + own_ema) * shape.params * pb}
        if device == "cpu":
            p.phases.append(Phase("export", export))
        else:
            p.host.update(export)
    return p


def _engine_share(cfg: Any, shape: ModelShape, gpu_memory: float | None, device: str, p: Plan) -> None:
    """The rollout engine's share of the device added to ``p``, as its backend declares it (``memory``: vLLM's
    in emapg.rollout.vllm_settings): a rollout phase when it sleeps through the update, else resident."""
    backend = BACKENDS[cfg.rollout.backend]
    declared = backend.builder("memory")
    if declared is None:
        p.notes.append(f"the {backend.name} backend declares no memory (Backend.memory): its engine is not counted")
        return
    m = declared(backend.settings_of(cfg.rollout.backend_args), shape.params, gpu_memory, device)
    p.notes += list(m.notes)
    p.engine_fix = m.fix
    if m.sleeps:
        p.phases.append(Phase("rollout", {f"{backend.name} engine (weights and cache)": m.share}))
    else:
        p.resident[f"{backend.name} engine, awake through the update"] = m.share


def _decoding(cfg: Any, shape: ModelShape, world: int, rows: int, prompt_tokens: int, budget: int,
              top_p: float | None = None) -> dict[str, float]:
    """The HF decode loop's parts for ``rows`` rows (``rollout.max_rows`` at a time) of ``budget`` new tokens."""
    cb = _compute_bytes(cfg)
    at_once = min(cfg.rollout.max_rows or rows, rows)
    step = STEP_BYTES + (TOP_P_BYTES if (cfg.rollout.top_p if top_p is None else top_p) < 1 else 0)
    parts = {"key/value cache": at_once * (prompt_tokens + budget) * shape.kv_bytes_per_token * cb,
             "decoding step buffers": at_once * shape.vocab * step,
             "per-token records": rows * budget * (20 + 8 * cfg.algo.k)}
    if world > 1:
        parts["gathered weights (FSDP)"] = shape.params * cb
    return {**parts, **_autocast_copies(cfg, shape, world)}


def _compute_bytes(cfg: Any) -> int:
    """Bytes of an activation element: 2 under bf16 mixed precision, else the weights' dtype's."""
    return 2 if cfg.mixed_precision == "bf16" else DTYPE_BYTES[cfg.dtype]


def _autocast_copies(cfg: Any, shape: ModelShape, world: int, head_only: bool = False) -> dict[str, float]:
    """One process under bf16 autocast around fp32 weights: the bf16 copies of the weights autocast keeps while
    its context is open (a decode loop, a pass without gradients); in a pass with gradients the layers' copies
    are in the calibration, the head's copy (the log-prob path's own cast) is not."""
    if world > 1 or cfg.mixed_precision != "bf16" or DTYPE_BYTES[cfg.dtype] == 2:
        return {}
    if head_only:
        return {"the head's bf16 copy (autocast)": shape.vocab * shape.hidden * 2}
    return {"autocast's bf16 copies of the weights": shape.params * 2}


def calibration(cfg: Any, world: int, checkpointing: bool) -> Calibration:
    """How the run's layers compute: under FSDP2 (2+ processes) bf16 mixed precision casts the weights, so the
    whole pass and what it saves is bf16; one process autocasts around fp32 weights (fp32 residual stream)."""
    lora = (cfg.lora.r, cfg.lora.alpha, tuple(cfg.lora.target_modules)) if cfg.lora.r else None
    if world > 1 and cfg.mixed_precision == "bf16":
        return Calibration("bfloat16", None, checkpointing, lora)
    return Calibration(cfg.dtype, cfg.mixed_precision, checkpointing, lora)


def micro_batch_shape(cfg: Any, world: int, prompt_tokens: int, budget: int) -> tuple[float, float]:
    """Prompts and rows of the largest micro-batch: ``micro_batch_prompts`` whole groups, or, packed by tokens
    (``micro_batch_tokens``), the budget filled with rows of the full length (a fraction of one counting its
    share: every term is linear in rows; at least one row, at most the process's mini-batch) over as many prompts
    as a run of that many rows can span (it may begin inside a group)."""
    n = cfg.rollout.n
    if not cfg.micro_batch_tokens:
        return cfg.micro_batch_prompts, cfg.micro_batch_prompts * n
    share = mini_batch_prompts(cfg) // world * n
    rows = min(share, max(1.0, cfg.micro_batch_tokens / (prompt_tokens + budget)))
    whole = math.ceil(rows)
    return min(whole, (whole + n - 2) // n + 1), rows


def _pass_phases(cfg: Any, shape: ModelShape, world: int, prompt_tokens: int, budget: int,
                 gradients: float) -> list[Phase]:
    """The reference passes (no grad) and the update of one micro-batch: with prefix sharing each prompt runs
    once and its keys and values are repeated per row (what :func:`emapg.models.forward.response_hidden` does)."""
    (prompts, rows), (pt, rt) = micro_batch_shape(cfg, world, prompt_tokens, budget), (prompt_tokens, budget)
    cb = _compute_bytes(cfg)
    sharing = cfg.prefix_sharing

    def saved(c: ActivationCost, prompt_pass: bool = True) -> float:
        return c.shared_layer_bytes(prompts * prompt_pass, rows, pt, rt) if sharing else c.layer_bytes(rows, pt + rt)

    gather = {"gathered layers (FSDP)": 2 * shape.layer_params * cb} if world > 1 else {}
    mask = {"attention mask (queries x keys)": rows * rt * (pt + rt) if sharing else rows * (pt + rt) ** 2}
    chunk = min(cfg.chunk_size, rows * rt) * shape.vocab * 4
    logits = {"head's logits chunk": chunk * HEAD_CHUNK_COPIES}
    reference = {"head's logits chunk": chunk * HEAD_NOGRAD_COPIES, **mask, **gather,
                 "hidden states": rows * rt * shape.hidden * 4, **_autocast_copies(cfg, shape, world),
                 "one layer's activations (no grad)": rows * (rt if sharing else pt + rt) * _nograd_bytes(shape, cb)}
    if sharing:
        reference["prompts' keys and values, repeated per row"] = rows * pt * shape.kv_bytes_per_token * cb
    cost = activation_cost(shape, calibration(cfg, world, cfg.gradient_checkpointing))
    wb = 2 if world > 1 and cfg.mixed_precision == "bf16" else DTYPE_BYTES[cfg.dtype]
    update = {"saved activations": shape.layers * saved(cost)
              + cost.pass_bytes(prompts, rows, pt, rt, sharing), **logits, **mask,
              **gather, "head's backward (weight gradient, hidden states and their gradient)":
                  shape.vocab * shape.hidden * wb * (cfg.lora.r == 0) + 2 * rows * rt * shape.hidden * 4,
              "gradients": gradients * (0.0 if cfg.offload else 1.0), **_autocast_copies(cfg, shape, world, True)}
    if cfg.gradient_checkpointing:  # a response layer replayed in the backward (the prompt pass keeps its own)
        update["one layer recomputed"] = saved(activation_cost(shape, calibration(cfg, world, False)), False)
    return [Phase("reference", reference), Phase("update", update)]


EVAL_BATCH = 64  # problems an evaluation decodes at once (emapg.run.evaluate), and a teacher-KL batch
TEACHER_KL_CHUNK = 256  # positions whose logits the teacher KL holds at once (emapg.run.teacher_kl)


def _eval_phases(cfg: Any, shape: ModelShape, teacher: ModelShape | None, world: int, prompt_tokens: int,
                 engine: bool) -> list[Phase]:
    """The held-out evaluation (the decode loop over 64 problems at a time, each with its samples; with vLLM
    the engine, already counted) and a distillation run's teacher KL: the teacher's greedy answers, then both
    models' exact KL over the vocabulary in float64, 256 positions at a time (emapg.run.teacher_kl), after both
    models' passes over the answers (the teacher's while the policy's hidden states wait)."""
    if not cfg.eval.size:
        return []
    # an agent's whole episode, else the evaluation's budget
    budget = cfg.task_args.get("max_total_tokens") or cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    problems = min(EVAL_BATCH, -(-cfg.eval.size // world))
    samples = 1 if cfg.eval.greedy else cfg.eval.samples
    top_p = 1.0 if cfg.eval.greedy else (cfg.rollout.top_p if cfg.eval.top_p is None else cfg.eval.top_p)
    phases = [] if engine else [Phase("evaluation", _decoding(cfg, shape, world, problems * samples,
                                                              prompt_tokens, budget, top_p))]
    if teacher is None or not cfg.eval.teacher_kl:
        return phases
    cb = _compute_bytes(cfg)
    tb = DTYPE_BYTES[cfg.algo.teacher_dtype or cfg.dtype] if cfg.mixed_precision != "bf16" else 2
    gather = {"gathered policy and teacher (FSDP)": shape.params * cb + teacher.params * tb} if world > 1 else {}
    answers = {"teacher's key/value cache": problems * (prompt_tokens + budget) * teacher.kv_bytes_per_token * tb,
               "teacher's decoding step buffers": problems * teacher.vocab * STEP_BYTES}
    positions = problems * budget
    hidden = {"the policy's hidden states": 2 * positions * shape.hidden * 4}  # each pass's output, its masked rows
    passes = {**hidden, "one layer's activations (no grad)": positions * max(_nograd_bytes(shape, cb),
                                                                           _nograd_bytes(teacher, tb))}
    logprobs = {**hidden, "the teacher's hidden states": 2 * positions * teacher.hidden * 4,
                "float64 log-probs of both models (256 positions)": min(TEACHER_KL_CHUNK, positions) * max(
                    shape.vocab, teacher.vocab) * (2 * 4 + 6 * 8)}
    return phases + [Phase("teacher's answers (evaluation)", {**answers, **gather}),
                     Phase("teacher KL passes (evaluation)", {**passes, **gather}),
                     Phase("teacher KL log-probs (evaluation)", {**logprobs, **gather})]


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
    if cfg.weight_ema is not None and cfg.algo.eta == 1.0:  # its own copy beside a frozen anchor (EMA-PG: the anchor)
        weights["weight EMA (weight_ema)" if cfg.lora.r == 0 else "weight EMA adapters (weight_ema)"] = (
            weights["anchor weights"] if cfg.lora.r == 0 else weights["anchor adapters"])
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
    key = (shape.config.to_json_string(use_diff=False), cfg.lora.r, str(cfg.lora.target_modules))
    if key not in _LORA:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape.config)
            peft = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                    target_modules=cfg.lora.target_modules))
        _LORA[key] = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    return _LORA[key]


def teacher_shape(cfg: Any) -> ModelShape | None:
    """The shape of ``algo.teacher`` (None without a teacher), its problems named as that field's."""
    return shape_of(model_config(cfg.algo.teacher, field="algo.teacher")) if cfg.algo.teacher else None


def run_plan(cfg: Any, config, task, tokenizer, *, world: int = 1, device: str = "cuda",
             gpu_memory: float | None = None, prompt_tokens: int | None = None,
             response_tokens: int | None = None) -> Plan:
    """The plan of a run as ``emapg train`` checks it: the model's ``config``, prompts as long as the task's
    longest (:func:`emapg.rollout.prompts.longest_prompt`), responses as long as its budget (an agent episode's whole
    budget), a teacher's config read from ``algo.teacher``; or at the lengths given."""
    teacher = teacher_shape(cfg)
    return plan(cfg, shape_of(config), world=world, prompt_tokens=prompt_tokens or longest_prompt(task, tokenizer),
                response_tokens=response_tokens or response_budget(task, cfg.rollout.max_new_tokens),
                gpu_memory=gpu_memory, teacher=teacher, device=device)


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
        lines.append(f"| host memory (offload, export) | {sum(p.host.values()) / GIB:.2f} |")
    return "\n".join(lines + [f"\n{note}" for note in p.notes])


def largest_fitting(cfg: Any, shape: ModelShape, capacity: float, **kw) -> dict[str, Any]:
    """The largest ``rollout.max_rows`` (hf backend) and ``micro_batch_prompts`` (or, packed by tokens,
    ``micro_batch_tokens`` in whole rows of the full length) that fit in ``capacity`` bytes, each tried with the
    other as configured (None: none fits)."""
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
    best, share = None, mini_batch_prompts(cfg) // kw.get("world", 1)
    if cfg.micro_batch_tokens:  # whole rows of the full length, up to the process's mini-batch
        row = kw.get("prompt_tokens", 512) + (kw.get("response_tokens") or cfg.rollout.max_new_tokens)
        name, values = "micro_batch_tokens", [row * m for m in range(1, share * cfg.rollout.n + 1)]
    else:  # whole micro-batches per process
        name, values = "micro_batch_prompts", [m for m in range(1, share + 1) if share % m == 0]
    for value in values:
        if _phase(plan(dataclasses.replace(cfg, **{name: value}), shape, **kw), "update") > capacity:
            break  # the update grows with the micro-batch
        best = value
    out[name] = best
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
    engine_awake = any("awake through the update" in part for part in p.resident)
    if p.engine_fix and ("rollout" in over or engine_awake):  # asleep, it counts in the rollout only
        fixes.append(p.engine_fix)
    if over & {"update", "reference"}:
        if not cfg.gradient_checkpointing and "update" in over:
            fixes.append("gradient_checkpointing=true")
        if cfg.micro_batch_tokens:
            fixes.append("a smaller micro_batch_tokens")
        elif cfg.micro_batch_prompts > 1:
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


    response_tokens = response_tokens or cfg.task_args.get("max_total_tokens") or cfg.rollout.max_new_tokens
    if cfg.mixed_precision == "auto":  # as the run would choose: bf16 on a GPU (A100, H100), this host's CPU as it is

        native = device == "cuda" or native_bf16(torch.device("cpu"))[0]
        cfg = dataclasses.replace(cfg, mixed_precision="bf16" if native else None)
    refused = None
    try:  # what `emapg train` refuses on this many processes, the plan does not call a fit
        check_world(cfg, gpus)
    except ConfigError as e:
        refused = str(e)
        if cfg.offload and gpus < 2:  # what one device would run instead: the plan of that
            cfg = dataclasses.replace(cfg, offload=False)
    shape = shape_of(model_config(cfg.model))
    teacher = teacher_shape(cfg)
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
    if refused and "offload" not in refused:  # nothing of this config runs here: no sizes to offer beside that
        return f"{head}\n{render(p, capacity)}\n\n{verdict}"
    best = largest_fitting(cfg, shape, capacity, **kw)
    sizes = ", ".join(f"{k}={v}" for k, v in best.items() if v is not None) or "none"
    which = "with offload=false (what one device runs), largest" if refused else "largest"
    return f"{head}\n{render(p, capacity)}\n\n{verdict}\n{which} that fit (each with the rest as set): {sizes}"
