"""What emapg needs to know of a Hugging Face causal LM besides its forward: its transformer body and
output projection, and the name its forward gives the key/value cache."""

from __future__ import annotations

import inspect

from torch import nn


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body (returns final, normed hidden states) and the output projection."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def cache_kwarg(module: nn.Module) -> str:
    """``cache`` or ``past_key_values``: transformers 5.x renamed the latter (deprecated, then removed)."""
    params = inspect.signature(type(module).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def set_pass_mode(model: nn.Module, grad: bool, lora_dropout: bool = False) -> None:
    """Module flags for a pass of ``model``: every module in eval mode (no dropout: the sampled,
    anchor and policy log-probs must be of one function), except, in a pass with gradients, the
    layers transformers checkpoints (they checkpoint only while ``training`` is true: without this
    ``gradient_checkpointing`` would do nothing) and, if asked, PEFT's LoRA dropout modules."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.eval()
    if not grad:
        return
    for name, m in model.named_modules():
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing:
            m.training = True  # this module only: its children (attention, MLP, dropout) stay in eval
        elif lora_dropout and ".lora_dropout." in f".{name}.":
            m.training = True
