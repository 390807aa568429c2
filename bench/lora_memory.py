"""Bytes of the EMA anchor: a full fp32 copy vs base + EMA(LoRA adapters), computed from model configs.

No weights are loaded: the models are built on the meta device and PEFT adds the adapters there.
The full anchor holds every parameter in fp32 (the EMA is kept in fp32); the LoRA anchor holds
only the adapters in fp32, since it shares the policy's frozen base.

    python bench/lora_memory.py --r 16
"""

from __future__ import annotations

import argparse

import torch

CONFIGS = {
    # SmolLM2-135M (Llama architecture), as the built-in model has it
    "SmolLM2-135M": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    # Qwen2.5-1.5B / R1-Distill-Qwen-1.5B (Qwen2 architecture), from its published config.json values
    "Qwen2.5-1.5B": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                   num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                   tie_word_embeddings=True)),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def anchor_bytes(kind: str, cfg: dict, r: int) -> tuple[int, int]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if kind == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    with torch.device("meta"):
        model = cls(cfg_cls(**cfg))
        full = sum(p.numel() for p in model.parameters())
        peft = get_peft_model(model, LoraConfig(r=r, target_modules=TARGETS))
        adapters = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    return 4 * full, 4 * adapters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--r", type=int, nargs="+", default=[8, 16, 64])
    args = p.parse_args()
    print("| model | LoRA rank | full fp32 anchor | LoRA anchor (fp32 adapters) | ratio |")
    print("|---|---|---|---|---|")
    for name, (kind, cfg) in CONFIGS.items():
        for r in args.r:
            full, lora = anchor_bytes(kind, cfg, r)
            print(f"| {name} | {r} | {full / 2**20:,.0f} MiB | {lora / 2**20:,.1f} MiB | {full / lora:,.0f}x |")


if __name__ == "__main__":
    main()
