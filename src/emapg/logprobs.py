"""Per-position log-probabilities from hidden states, chunk by chunk over positions (spec section 5).

The output projection of a language model maps ``[N, H]`` hidden states to ``[N, V]`` logits, with V
up to 150k+. Everything EMA-PG needs from those logits is small: the log-sum-exp, the sampled
token's log-prob, log-probs at ``k`` given ids, the top-k ids, the entropy. :func:`token_logprobs`
computes them one chunk of positions at a time and, with gradients on and more than one chunk,
recomputes each chunk's logits in the backward pass (``torch.utils.checkpoint``), so no more than
one ``[chunk, V]`` block is alive in either pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


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


def _chunk_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    ids: Tensor | None,
    temperature: float,
    k_self: int,
    entropy: bool,
) -> tuple[Tensor, ...]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    # cross_entropy = lse - logit[token] is one fused pass forward and backward (softmax - onehot);
    # lse then follows from the gathered logit, with the right gradient (softmax).
    nll = torch.nn.functional.cross_entropy(logits, tokens, reduction="none")
    picked = logits.gather(-1, tokens.unsqueeze(-1) if ids is None else torch.cat([tokens.unsqueeze(-1), ids], -1))
    lse = picked[:, 0] + nll
    out = [-nll, lse]
    if ids is not None:
        out.append(picked[:, 1:] - lse.unsqueeze(-1))
    with torch.no_grad():
        if k_self > 0:
            top = logits.topk(min(k_self, logits.shape[-1]), -1)
            out += [top.indices, top.values - lse.unsqueeze(-1)]
        if entropy:
            probs = torch.softmax(logits, -1)
            out.append(lse - (probs * logits).sum(-1))
    return tuple(out)


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
    Returns:
        :class:`TokenLogprobs`; gradients equal those of the naive full-logits computation.
    """
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    # With grad and several chunks, only each chunk's inputs are saved and its logits are
    # recomputed in backward. A single chunk keeps its logits: that is one chunk's memory anyway.
    recompute = grad and hidden.shape[0] > chunk_size
    chunks: list[tuple[Tensor, ...]] = []
    for start in range(0, hidden.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        args = (hidden[sl], weight, bias, tokens[sl], None if ids is None else ids[sl], temperature, k_self, entropy)
        chunks.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if recompute else _chunk_stats(*args))
    if not chunks:
        chunks = [_chunk_stats(hidden[:0], weight, bias, tokens[:0], None if ids is None else ids[:0],
                               temperature, k_self, entropy)]
    cols = iter([torch.cat(list(c)) for c in zip(*chunks, strict=True)])
    return TokenLogprobs(
        logp_tok=next(cols),
        lse=next(cols),
        logp_ids=next(cols) if ids is not None else None,
        topk_ids=next(cols) if k_self > 0 else None,
        topk_logp=next(cols) if k_self > 0 else None,
        entropy=next(cols) if entropy else None,
    )
