"""The GRPO objective around the KL term (docs/METHOD.md section 4), as pure functions over tensors.

Shapes: B responses, L response positions (padded), ``mask`` [B, L] is 1 where the model
generated the token and the token counts in the loss (0 for padding and for tool output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def _grpo(r: Tensor, mean: Tensor, eps: float) -> Tensor:
    """(R - mean) / (std + eps), std unbiased as in the reference code (0 for groups of one)."""
    std = r.std(-1, keepdim=True) if r.shape[-1] > 1 else torch.zeros_like(mean)
    return (r - mean) / (std + eps)


def _drgrpo(r: Tensor, mean: Tensor, eps: float) -> Tensor:
    """R - mean (Dr. GRPO: no division by the std)."""
    return r - mean


def _rloo(r: Tensor, mean: Tensor, eps: float) -> Tensor:
    """R - mean of the other responses of the group (needs groups of at least two)."""
    g = r.shape[-1]
    if g < 2:
        raise ValueError("rloo needs group_size >= 2")
    return (r - mean) * g / (g - 1)


# The advantage estimators, declared as the KL estimators are (emapg.kl.ESTIMATORS): name -> function of
# the rewards [G, group] (float64), their group means [G, 1] and eps. The config's table reads the names.
ADVANTAGES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {"grpo": _grpo, "drgrpo": _drgrpo, "rloo": _rloo}


def register_advantage(name: str, fn: Callable[[Tensor, Tensor, float], Tensor]) -> None:
    """Add an advantage estimator from your own module: ``fn(rewards [G, group], means [G, 1], eps)``; the
    config's ``algo.advantage`` takes its name at once."""
    if name in ADVANTAGES:
        raise ValueError(f"an advantage estimator named {name!r} exists already")
    ADVANTAGES[name] = fn


def group_advantages(rewards: Tensor, group_size: int, mode: str = "grpo", eps: float = 1e-6) -> Tensor:
    """One advantage per response from rewards of consecutive groups of ``group_size``.

    rewards: [B] with B a multiple of group_size, responses of a prompt adjacent.
    mode: a name of :data:`ADVANTAGES`: ``grpo`` (R - mean) / (std + eps); ``drgrpo`` R - mean;
    ``rloo`` R - mean of the other responses. Returns [B].
    """
    if mode not in ADVANTAGES:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {', '.join(ADVANTAGES)}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size).to(torch.float64)
    adv = ADVANTAGES[mode](r, r.mean(-1, keepdim=True), eps)
    return adv.reshape(-1).to(rewards.dtype)


@dataclass
class SurrogateOut:
    """Per-token clipped surrogate loss [B, L] and diagnostics [B, L] (floats 0/1)."""

    loss: Tensor
    clipped: Tensor
    dual_clipped: Tensor
    ratio: Tensor


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = 3.0,
) -> SurrogateOut:
    """PPO clipped surrogate with asymmetric clip and the dual clip for negative advantages.

    logp, old_logp: [B, L] log pi_theta and log pi_old of the sampled tokens.
    advantages: [B] (broadcast over tokens) or [B, L].
    loss = max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high)); where A < 0 it is capped at -A c.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    ratio = torch.exp(logp - old_logp.detach())
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = ((adv < 0) & (loss > cap)).float()
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return SurrogateOut(loss=loss, clipped=clipped.detach(), dual_clipped=dual.detach(), ratio=ratio.detach())


def _token_mean(kept: Tensor, mask: Tensor, num_tokens: float | None, max_len: int | None) -> Tensor:
    """sum(v m) / num_tokens: the whole (mini-)batch's tokens weigh alike. Returns a scalar."""
    denom = mask.sum() if num_tokens is None else num_tokens
    return kept.sum() / max(float(denom), 1.0)


def _seq_token_mean(kept: Tensor, mask: Tensor, num_tokens: float | None, max_len: int | None) -> Tensor:
    """Per sequence: mean over its tokens. Returns [B]."""
    return kept.sum(-1) / mask.sum(-1).clamp(min=1)


def _seq_token_sum_norm(kept: Tensor, mask: Tensor, num_tokens: float | None, max_len: int | None) -> Tensor:
    """Per sequence: sum over its tokens / the constant max_len (Dr. GRPO). Returns [B]."""
    if max_len is None:
        raise ValueError("seq-mean-token-sum-norm needs max_len (the constant response length)")
    return kept.sum(-1) / max_len


# The loss aggregations: name -> (function, whether its output is per sequence [B], then averaged over
# num_seqs, or already the scalar). Declared once; the config's table reads the names.
AGGREGATIONS: dict[str, tuple[Callable[..., Tensor], bool]] = {
    "token-mean": (_token_mean, False),
    "seq-mean-token-mean": (_seq_token_mean, True),
    "seq-mean-token-sum-norm": (_seq_token_sum_norm, True),
}


def register_aggregation(name: str, fn: Callable[..., Tensor], per_sequence: bool) -> None:
    """Add a loss aggregation from your own module: ``fn(kept [B, L], mask [B, L], num_tokens, max_len)``
    returns [B] (``per_sequence``: then averaged over the batch's sequences) or the scalar; ``algo.agg`` takes it."""
    if name in AGGREGATIONS:
        raise ValueError(f"an aggregation named {name!r} exists already")
    AGGREGATIONS[name] = (fn, per_sequence)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce per-token values [B, L] over the masked tokens to a scalar (a mode of :data:`AGGREGATIONS`).

    token-mean: sum(v m) / num_tokens; seq-mean-token-mean: sum_i mean_t(v_i) / num_seqs;
    seq-mean-token-sum-norm (Dr. GRPO): sum_i sum_t(v_i) / max_len / num_seqs.
    ``num_tokens`` and ``num_seqs`` are the counts of the *whole* batch: pass them when ``values``
    is one micro-batch so that the micro-batch losses add up to the full-batch loss exactly.
    They default to this batch's own counts. Masked positions count nothing, whatever they hold (a
    non-finite value there is ignored).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
    fn, per_seq = AGGREGATIONS[mode]
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    out = fn(kept, mask.to(values.dtype), num_tokens, max_len)
    if not per_seq:
        return out
    seqs = values.shape[0] if num_seqs is None else num_seqs
    return out.sum() / max(float(seqs), 1.0)
