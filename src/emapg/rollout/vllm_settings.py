"""The vLLM backend's settings (``rollout.backend_args`` when ``rollout.backend: vllm``) and what its engine takes
of a device's memory, for the memory plan. Pure: nothing here imports vLLM or torch, so a config is checked and a
run is planned where vLLM is not installed."""

from __future__ import annotations

from dataclasses import dataclass

from emapg.backends import EngineMemory
from emapg.settings import at_least, setting, within

GIB = 1024**3


@dataclass(frozen=True)
class VLLMSettings:
    gpu_memory: float = setting(0.3, rule=within(0, 1, low_open=True, high_open=True))
    """On CUDA: the fraction of the GPU's memory the engine may take (weights + KV cache), beside training."""
    max_model_len: int | None = setting(None, rule=at_least(2, null=True))
    """The longest prompt + response the engine plans for (None = measured from the task's prompts plus the
    response budget, at most the model's context)."""
    kv_cache_gib: int | None = setting(None, rule=at_least(1, null=True))
    """On the CPU: the engine's KV cache in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; None = room for every row of a
    rollout at max_model_len, at most half the free memory; too little memory is an error)."""
    sleep: bool = False
    """On CUDA: free the engine's GPU memory during the update (its weights are pushed again before a rollout).
    The CPU backend has no sleep mode."""
    seeds: bool = True
    """Seed every request from the run's seed, the step, the rank and the prompt (reproducible samples, a resume
    that replays them); false lets requests draw from the engine's own generator (seeded once at its start):
    vLLM's batched sampling path, faster on a GPU than a generator per request, but a run's samples then depend
    on how vLLM batches them."""
    enforce_eager: bool | None = None
    """Run the model eagerly (no CUDA graphs / torch.compile): faster start, slower decoding. None = true on the
    CPU (compiling takes minutes on a few cores), false on CUDA."""


def engine_memory(s: VLLMSettings, params: float, gpu_memory: float | None, device: str) -> EngineMemory:
    """vLLM's share of a device: ``gpu_memory`` (bytes) x the settings' fraction on CUDA; on the CPU its fp32
    weights (``params`` of them) and its own KV cache."""
    if device == "cpu":  # the CPU engine holds no share of a device: its weights and its own KV cache
        notes = () if s.kv_cache_gib is not None else (
            "the CPU vLLM engine's KV cache is sized from the run: set rollout.backend_args.kv_cache_gib to count it",)
        return EngineMemory(params * 4 + (s.kv_cache_gib or 0) * GIB, sleeps=False, notes=notes,
                            fix="a smaller rollout.backend_args.kv_cache_gib")
    notes = () if gpu_memory is not None else ("vLLM's share is a fraction of the GPU: give --gpu-memory to count it",)
    return EngineMemory(s.gpu_memory * (gpu_memory or 0.0), sleeps=s.sleep, notes=notes,
                        fix=f"a lower rollout.backend_args.gpu_memory (the engine takes {s.gpu_memory:g} of the device "
                            "while it is awake)")
