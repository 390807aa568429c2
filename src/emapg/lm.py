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
