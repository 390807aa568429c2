"""What emapg needs of a Hugging Face causal LM besides its forward: its transformer body and output projection,
the name its forward gives the key/value cache, how many characters its tokenizer's tokens can stand for (so that
no text of megabytes is tokenized whole), and the head's log-probabilities, chunk by chunk over positions
(docs/METHOD.md section 5).

The output projection of a language model maps ``[N, H]`` hidden states to ``[N, V]`` logits, with V
up to 150k+. Everything EMA-PG needs from those logits is small: the log-sum-exp, the sampled
token's log-prob, log-probs at ``k`` given ids, the top-k ids, the entropy. :func:`token_logprobs`
computes them one chunk of positions at a time through :class:`_HeadStats`, an autograd function
over the head (linear + log-softmax statistics + gathers) whose backward recomputes each chunk's
logits and accumulates the weight gradient in place. So no more than one ``[chunk, V]`` block is
alive in either pass, and the number of chunks does not change the peak memory: autograd, left to
itself, would sum per-chunk ``[V, H]`` weight gradients out of place.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.modeling_layers import GradientCheckpointingLayer

from emapg.errors import ConfigError


@dataclass
class TokenLogprobs:
    """What one pass of a model yields per position. N = number of positions.

    logp_tok: [N] log-prob of the given token (differentiable when the inputs are).
    logp_ids: [N, k] log-probs at the given ids, or None.
    topk_ids: [N, k_self] this distribution's own top-k ids (no grad), or None.
    topk_logp: [N, k_self] its log-probs at those ids (no grad), or None.
    entropy: [N] entropy of the distribution (no grad), or None.
    lse: [N] log-sum-exp of the tempered logits.
    """

    logp_tok: Tensor
    lse: Tensor
    logp_ids: Tensor | None = None
    topk_ids: Tensor | None = None
    topk_logp: Tensor | None = None
    entropy: Tensor | None = None


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype of the head's matrix products: autocast's when it is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


@dataclass(frozen=True)
class HeadTransform:
    """What a model's forward applies to ``hidden @ W.T + b`` before it returns logits:
    ``softcap * tanh(scale * z / softcap)`` (Gemma-2's final_logit_softcapping), or ``scale * z``
    (Cohere's logit_scale, 1 / Granite's logits_scaling)."""

    scale: float = 1.0
    softcap: float | None = None


PLAIN = HeadTransform()


def head_logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float, tf: HeadTransform) -> Tensor:
    """Tempered logits of a chunk, in fp32 at least (fp64 inputs stay fp64)."""
    return transform_logits(torch.nn.functional.linear(h, w, None if b is None else b.to(w.dtype)), temperature, tf)


def transform_logits(z: Tensor, temperature: float, tf: HeadTransform) -> Tensor:
    """The model's transform and the temperature applied to raw head outputs ``h . W_j + b_j``, in
    fp32 at least."""
    z = z.float() if z.dtype in (torch.bfloat16, torch.float16) else z
    if tf.scale != 1.0:
        z = z * tf.scale
    if tf.softcap is not None:
        z = torch.tanh(z / tf.softcap) * tf.softcap
    return z / temperature if temperature != 1.0 else z


def _head_slope(z: Tensor, temperature: float, tf: HeadTransform) -> Tensor | float:
    """d z / d (hidden @ W.T + b) at tempered logits ``z`` (elementwise, or a constant)."""
    if tf.softcap is None:
        return tf.scale / temperature
    t = z * (temperature / tf.softcap)  # tanh of the capped pre-activation
    return (1 - t * t) * (tf.scale / temperature)


class _HeadStats(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, tokens [N], ids [N, k] | None) ->
    logp_tok [N], lse [N], logp_ids [N, k], and no-grad topk_ids, topk_logp [N, k_self], entropy [N]
    (empty tensors for what was not asked)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, ids, temperature, chunk_size, k_self, want_entropy, tf):
        cd = _compute_dtype(hidden, weight)
        n, k = hidden.shape[0], 0 if ids is None else ids.shape[1]
        w = weight.to(cd)
        outs = {"tok": [], "lse": [], "ids": [], "topi": [], "topl": [], "ent": []}
        kept = None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, max(n, 1), chunk_size):
                sl = slice(start, start + chunk_size)
                z = head_logits(hidden[sl].to(cd), w, bias, temperature, tf)
                lse = torch.logsumexp(z, -1)
                outs["lse"].append(lse)
                outs["tok"].append(z.gather(-1, tokens[sl, None]).squeeze(-1) - lse)
                if k:
                    outs["ids"].append(z.gather(-1, ids[sl]) - lse[:, None])
                if k_self:
                    top = z.topk(min(k_self, z.shape[-1]), -1)
                    outs["topi"].append(top.indices)
                    outs["topl"].append(top.values - lse[:, None])
                if want_entropy:
                    outs["ent"].append(lse - (torch.softmax(z, -1) * z).sum(-1))
                kept = z if n <= chunk_size else None  # one chunk: keep its logits, recompute nothing
        res = [torch.cat(v) if v else hidden.new_empty(0) for v in outs.values()]
        ctx.mark_non_differentiable(*res[3:])
        ctx.cd, ctx.temperature, ctx.chunk_size, ctx.kept, ctx.tf = cd, temperature, chunk_size, kept, tf
        ctx.save_for_backward(hidden, weight, bias, tokens, ids, res[1])
        return tuple(res)

    @staticmethod
    def backward(ctx, g_tok, g_lse, g_ids, *_):
        hidden, weight, bias, tokens, ids, lse = ctx.saved_tensors
        cd, t, cs, tf = ctx.cd, ctx.temperature, ctx.chunk_size, ctx.tf
        w = weight.to(cd)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], cs):
                sl = slice(start, start + cs)
                h = hidden[sl].to(cd)
                z = ctx.kept if ctx.kept is not None else head_logits(h, w, bias, t, tf)
                # d/dz of g_tok * logp_tok + g_lse * lse + sum g_ids * logp_ids
                # = onehot(tok) g_tok + onehot(ids) g_ids + softmax(z) (g_lse - g_tok - sum g_ids)
                coef = g_lse[sl] - g_tok[sl]
                if ids is not None:
                    coef = coef - g_ids[sl].sum(-1)
                dz = torch.exp(z - lse[sl, None]).mul_(coef[:, None].to(z.dtype))
                dz.scatter_add_(1, tokens[sl, None], g_tok[sl, None].to(z.dtype))
                if ids is not None:
                    dz.scatter_add_(1, ids[sl], g_ids[sl].to(z.dtype))
                slope = _head_slope(z, t, tf)  # back through temperature (and the model's transform)
                dz = (dz.mul_(slope) if torch.is_tensor(slope) or slope != 1.0 else dz).to(cd)
                if need_h:
                    grad_h[sl] = dz @ w
                if need_w:
                    if grad_w.dtype == cd:
                        grad_w.addmm_(dz.T, h)  # in place: no [V, H] per chunk
                    else:
                        grad_w.add_(dz.T @ h)  # autocast: the product in cd, one transient [V, H]
                if need_b:
                    grad_b.add_(dz.sum(0).to(grad_b.dtype))
                del z, dz
        ctx.kept = None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    ids: Tensor | None = None,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    k_self: int = 0,
    entropy: bool = False,
    chunk_size: int = 1024,
    transform: HeadTransform = PLAIN,
) -> TokenLogprobs:
    """Log-probabilities at each position from hidden states and the output projection.

    Args:
        hidden: [N, H] final hidden states at the positions that predict ``tokens``.
        weight: [V, H] output projection (``lm_head.weight``); bias: [V] or None.
        tokens: [N] the token whose log-prob is wanted at each position.
        ids: [N, k] extra ids to gather log-probs at (the top-k head), or None.
        temperature: logits are divided by it, as during sampling.
        k_self: also return this distribution's own top-k ids (no grad).
        entropy: also return the entropy (no grad).
        chunk_size: positions per chunk; peak memory is about chunk_size x V floats.
        transform: what the model's forward applies to its head's output (see :func:`emapg.models.lm.head_transform`).
    Returns:
        :class:`TokenLogprobs`; gradients equal those of the naive full-logits computation.
    """
    logp_tok, lse, logp_ids, top_i, top_l, ent = _HeadStats.apply(
        hidden, weight, bias, tokens, ids, temperature, chunk_size, k_self, entropy, transform)
    return TokenLogprobs(
        logp_tok=logp_tok, lse=lse,
        logp_ids=logp_ids if ids is not None else None,
        topk_ids=top_i if k_self > 0 else None,
        topk_logp=top_l if k_self > 0 else None,
        entropy=ent if entropy else None,
    )


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
