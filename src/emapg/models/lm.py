"""What emapg needs to know of a Hugging Face causal LM besides its forward: its transformer body and
output projection, the name its forward gives the key/value cache, and how many characters its tokenizer's
tokens can stand for (so that no text of megabytes is tokenized whole)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers.modeling_layers import GradientCheckpointingLayer

from emapg.errors import ConfigError
from emapg.logprobs import HeadTransform, head_logits


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body (returns final, normed hidden states) and the output projection."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def cache_kwarg(module: nn.Module) -> str:
    """``cache`` or ``past_key_values``: transformers 5.x renamed the latter (deprecated, then removed)."""
    params = inspect.signature(type(module).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def positions(mask: Tensor) -> Tensor:
    """Position ids [B, L] of a 0/1 attention mask: each real token's count of real tokens before it
    (0 on masked columns), as ``generate`` computes them; padding may stand anywhere."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in eval mode inside the block; each module's own flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def set_pass_mode(model: nn.Module, grad: bool, lora_dropout: bool = False) -> None:
    """Module flags for a pass of ``model``: every module in eval mode (no dropout: the sampled,
    anchor and policy log-probs must be of one function), except, in a pass with gradients, the
    layers transformers checkpoints (they checkpoint only while ``training`` is true: without this
    ``gradient_checkpointing`` would do nothing) and, if asked, PEFT's LoRA dropout modules."""
    model.eval()
    if not grad:
        return
    for name, m in model.named_modules():
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing:
            m.training = True  # this module only: its children (attention, MLP, dropout) stay in eval
        elif lora_dropout and ".lora_dropout." in f".{name}.":
            m.training = True


def head_transform(model: nn.Module) -> HeadTransform:
    """What ``model``'s forward does to its head's output, read from its config: Gemma-2/3's
    ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    return HeadTransform(scale=scale, softcap=float(softcap) if softcap else None)


KNOWN_TRANSFORMS = "final_logit_softcapping, logit_scale, logits_scaling"


@torch.no_grad()
def check_lean_head(model: nn.Module, name: str) -> None:
    """Refuse a model whose logits emapg's lean path (body, then head, then :func:`head_transform`)
    does not reproduce: the ratio and the KL would refer to another distribution than the sampler's.
    One forward of 8 tokens, both ways."""
    decoder, head = decoder_and_head(model)
    vocab = head.weight.shape[0]
    ids = torch.arange(8, device=head.weight.device).view(1, 8) * 7919 % vocab
    with eval_mode(model):
        want = model(input_ids=ids).logits[0].float()
        hidden = decoder(input_ids=ids).last_hidden_state[0]
        got = head_logits(hidden, head.weight, getattr(head, "bias", None), 1.0, head_transform(model)).float()
    err = float((torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max())
    if not err <= 1e-3 * max(1.0, float(want.abs().max())):
        cfg = getattr(model, "config", None)
        raise ConfigError(
            f"model {name} ({type(model).__name__}): its forward post-processes the logits in a way emapg's lean "
            f"log-prob path does not reproduce (log-probs differ by {err:.3g}; the config fields it knows are "
            f"{KNOWN_TRANSFORMS}; this config is {getattr(cfg, 'model_type', '?')}): refused, since the ratio and "
            "the KL would refer to another distribution than the one sampled")


_TOKEN_BYTES: dict[int, int] = {}


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token of ``tokenizer`` stands for (its added tokens' text included): a text of B
    bytes makes at least B / this many tokens, whatever it holds. Measured once per tokenizer."""
    key = id(tokenizer)
    if key not in _TOKEN_BYTES:
        vocab = tokenizer.get_vocab()
        raw = max((len(t.encode("utf-8")) for t in vocab), default=1)  # a token's symbol: at least its bytes
        decoded = max((len(tokenizer.convert_tokens_to_string([t]).encode("utf-8")) for t in vocab), default=1)
        _TOKEN_BYTES[key] = max(1, raw, decoded)
    return _TOKEN_BYTES[key]


def first_tokens_text(text: str, tokens: int, tokenizer) -> str:
    """``text``, cut by characters to what its first ``tokens`` tokens can stand for (with a margin that keeps
    those tokens the whole text's for any text without a 1,000-character word), before it is tokenized: a passage
    of 50 MB took seconds and gigabytes to tokenize for the few hundred tokens kept."""
    most = tokens * longest_token_bytes(tokenizer) + 1024
    return text if len(text) <= most else text[:most]


def tied_names(model: nn.Module) -> set[str]:
    """State-dict names that share storage with an earlier name (a tied LM head): not saved separately, and
    absent from a model folder's weights without being missing."""
    seen, tied = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if t.data_ptr() in seen:
            tied.add(name)
        seen.setdefault(t.data_ptr(), name)
    return tied


def non_finite(model: nn.Module) -> list[str]:
    """The parameters of ``model`` holding a NaN or an infinity, in this process's rows (a sharded model's)."""
    with torch.no_grad():
        return [n for n, p in model.named_parameters()
                if p.is_floating_point() and not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()]
