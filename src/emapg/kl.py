"""Token-level KL estimators of EMA-PG (spec section 3).

Notation at one position: ``p`` is the sampled token, drawn from ``pi_samp``; ``sg`` is stop-gradient;
``r = pi(p) / sg(pi(p))`` (value 1, gradient grad log pi(p)); ``w = anchor(p) / pi(p)``;
``s = sg(pi(p) / pi_samp(p))`` the importance weight (1 on-policy), optionally clipped from above.

Two forms of the same estimators live here:

* the **reference form**, :func:`token_kl`, on full ``[..., V]`` logits: easy to read and to test;
* the **lean form**, :func:`kl_from_logprobs`, on gathered log-probabilities (the sampled token's
  and those of the ``k`` top-k ids) computed chunk by chunk by :mod:`emapg.logprobs`; it never needs
  a ``[positions, V]`` tensor. Tests prove both give the same values and gradients.

``form="unbiased"`` (default) is the corrected top-k estimator; ``form="paper"`` reproduces the
reference code's formulas, whose gradient is off by ``+grad pi(q)`` (reverse) and ``-grad pi(q)``
(forward) for ``0 < k < V``. Spec section 3 explains why.
"""

from __future__ import annotations

import torch
from torch import Tensor

SAMPLED_ESTIMATORS = ("k1", "k2", "k3", "k3pp", "k4", "k5")
EXACT_ESTIMATORS = ("exact_reverse", "exact_forward")
TOPK_ESTIMATORS = ("topk_reverse", "topk_forward")
ESTIMATORS = SAMPLED_ESTIMATORS + EXACT_ESTIMATORS + TOPK_ESTIMATORS
FORMS = ("unbiased", "paper")


def check_estimator(estimator: str, form: str = "unbiased", k: int = 0) -> None:
    """Raise a ValueError naming the bad argument if ``estimator``/``form``/``k`` are invalid."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")
    if form not in FORMS:
        raise ValueError(f"unknown KL form {form!r}; expected one of {', '.join(FORMS)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def direction(estimator: str) -> str:
    """``"reverse"`` if the estimator targets KL(pi || anchor), ``"forward"`` for KL(anchor || pi).

    Which direction also decides whose top-k ids are used: ``pi_samp``'s for reverse, the
    anchor's for forward. k2's value is biased, its gradient is the reverse KL's.
    """
    return "forward" if estimator in ("k5", "exact_forward", "topk_forward") else "reverse"


def _ratio(logp: Tensor) -> Tensor:
    """r = pi / sg(pi): value exactly 1, gradient grad log pi."""
    return torch.exp(logp - logp.detach())


def importance_weight(policy_logp_tok: Tensor, samp_logp_tok: Tensor | None, is_clip: float | None) -> Tensor:
    """s = sg(pi(p) / pi_samp(p)), clipped from above at ``is_clip`` when given. Shape of the inputs."""
    if samp_logp_tok is None:
        return torch.ones_like(policy_logp_tok).detach()
    s = torch.exp(policy_logp_tok.detach() - samp_logp_tok.detach())
    if is_clip is not None:
        s = s.clamp(max=is_clip)
    return s


def sampled_kl(estimator: str, policy_logp_tok: Tensor, anchor_logp_tok: Tensor) -> Tensor:
    """The single-sample estimators k1..k5 at the sampled token, before the importance weight.

    policy_logp_tok, anchor_logp_tok: [...] log pi(p) and log anchor(p). Returns [...].
    """
    log_w = anchor_logp_tok - policy_logp_tok
    if estimator == "k1":
        return -log_w
    if estimator == "k2":
        return 0.5 * log_w**2
    if estimator == "k3":
        return torch.exp(log_w) - 1 - log_w
    if estimator == "k3pp":
        return _ratio(policy_logp_tok) * (torch.exp(log_w) - 1 - log_w)
    if estimator == "k4":
        return _ratio(policy_logp_tok) * (-log_w).detach()
    if estimator == "k5":
        return torch.exp(log_w).detach() * log_w + torch.log(_ratio(policy_logp_tok))
    raise ValueError(f"{estimator!r} is not a sampled estimator")


def topk_tail(
    estimator: str, form: str, policy_logp_tok: Tensor, anchor_logp_tok: Tensor, in_q: Tensor
) -> Tensor:
    """The sampled tail correction of the top-k estimators, before the importance weight.

    in_q: [...] bool, whether the sampled token is one of the k head tokens. Returns [...].
    """
    outside = (~in_q).to(policy_logp_tok.dtype)
    r = _ratio(policy_logp_tok)
    if estimator == "topk_reverse":
        tail = r * (policy_logp_tok - anchor_logp_tok).detach()
        if form == "unbiased":
            tail = tail + (r - 1)  # value 0; its expected gradient cancels the head weights' grad pi(q)
    elif estimator == "topk_forward":
        log_w = anchor_logp_tok - policy_logp_tok
        tail = torch.exp(log_w).detach() * log_w
        if form == "paper":
            tail = tail + torch.log(r)  # zero-mean only over the whole vocabulary: biased for 0 < k < V
    else:
        raise ValueError(f"{estimator!r} is not a top-k estimator")
    return outside * tail


def topk_head(estimator: str, policy_logp_q: Tensor, anchor_logp_q: Tensor) -> Tensor:
    """Exact head of the top-k estimators over the k gathered ids. Inputs [..., k]; returns [...]."""
    if estimator in ("topk_reverse", "exact_reverse"):
        return (policy_logp_q.exp() * (policy_logp_q - anchor_logp_q)).sum(-1)
    return (anchor_logp_q.exp() * (anchor_logp_q - policy_logp_q)).sum(-1)


def kl_from_logprobs(
    estimator: str,
    policy_logp_tok: Tensor,
    anchor_logp_tok: Tensor,
    *,
    samp_logp_tok: Tensor | None = None,
    policy_logp_q: Tensor | None = None,
    anchor_logp_q: Tensor | None = None,
    in_q: Tensor | None = None,
    form: str = "unbiased",
    is_clip: float | None = None,
) -> Tensor:
    """Lean form: the per-position KL estimate from gathered log-probabilities.

    Args:
        policy_logp_tok: [...] log pi_theta(p) of the sampled token (differentiable).
        anchor_logp_tok: [...] log anchor(p).
        samp_logp_tok: [...] log pi_samp(p); None means on-policy (s = 1).
        policy_logp_q, anchor_logp_q: [..., k] log-probs at the head ids q (top-k estimators; for
            the exact estimators pass all V ids). Normalised by each distribution's full
            log-sum-exp, so only k values per position are ever stored.
        in_q: [...] bool, sampled token in q (top-k estimators only).
        With ``policy_logp_q=None`` a top-k estimator runs with k = 0 (no head, all tail).
    Returns:
        [...] the estimate, differentiable w.r.t. the policy's log-probs.
    """
    check_estimator(estimator, form)
    if estimator in EXACT_ESTIMATORS:
        return topk_head(estimator, policy_logp_q, anchor_logp_q)
    s = importance_weight(policy_logp_tok, samp_logp_tok, is_clip)
    if estimator in SAMPLED_ESTIMATORS:
        return s * sampled_kl(estimator, policy_logp_tok, anchor_logp_tok)
    if policy_logp_q is None or policy_logp_q.shape[-1] == 0:  # k = 0: no head, every token is tail
        head = torch.zeros_like(policy_logp_tok)
        in_q = torch.zeros_like(policy_logp_tok, dtype=torch.bool)
    else:
        head = topk_head(estimator, policy_logp_q, anchor_logp_q)
    return head + s * topk_tail(estimator, form, policy_logp_tok, anchor_logp_tok, in_q)


def head_ids(estimator: str, k: int, samp_logits: Tensor, anchor_logits: Tensor) -> Tensor:
    """The head ids q: top-k of pi_samp (reverse) or of the anchor (forward). Returns [..., k] long."""
    source = anchor_logits if direction(estimator) == "forward" else samp_logits
    k = min(k, source.shape[-1])
    return source.detach().topk(k, dim=-1).indices


def token_kl(
    policy_logits: Tensor,
    anchor_logits: Tensor,
    tokens: Tensor,
    *,
    estimator: str = "topk_reverse",
    k: int = 32,
    sampling_logits: Tensor | None = None,
    form: str = "unbiased",
    is_clip: float | None = None,
) -> Tensor:
    """Reference form: the per-position KL estimate from full logits.

    Args:
        policy_logits, anchor_logits, sampling_logits: [..., V], already at the sampling
            temperature. ``sampling_logits=None`` means on-policy: pi_samp = sg(pi_theta).
        tokens: [...] the sampled token at each position.
        estimator: one of :data:`ESTIMATORS`. k: head size for the top-k estimators (0..V).
        form: ``"unbiased"`` or ``"paper"`` (top-k only). is_clip: clip s from above.
    Returns:
        [...] the estimate, differentiable w.r.t. ``policy_logits``.

    The head is written over the whole vocabulary with a 0/1 mask (no gather), so it is an
    independent computation from :func:`kl_from_logprobs`, which tests compare it with.
    """
    check_estimator(estimator, form, k)
    logp = torch.log_softmax(policy_logits, -1)
    loga = torch.log_softmax(anchor_logits.detach(), -1)
    if estimator == "exact_reverse":
        return (logp.exp() * (logp - loga)).sum(-1)
    if estimator == "exact_forward":
        return (loga.exp() * (loga - logp)).sum(-1)
    tokens = tokens.unsqueeze(-1)
    logp_tok = logp.gather(-1, tokens).squeeze(-1)
    loga_tok = loga.gather(-1, tokens).squeeze(-1)
    samp_logp_tok = None
    samp_logits = policy_logits
    if sampling_logits is not None:
        samp_logits = sampling_logits
        samp_logp_tok = torch.log_softmax(sampling_logits.detach(), -1).gather(-1, tokens).squeeze(-1)
    s = importance_weight(logp_tok, samp_logp_tok, is_clip)
    if estimator in SAMPLED_ESTIMATORS:
        return s * sampled_kl(estimator, logp_tok, loga_tok)
    mask = torch.zeros_like(logp)
    if k > 0:
        mask.scatter_(-1, head_ids(estimator, k, samp_logits, anchor_logits), 1.0)
    in_q = mask.gather(-1, tokens).squeeze(-1).bool()
    if estimator == "topk_reverse":
        head = (mask * logp.exp() * (logp - loga)).sum(-1)
    else:
        head = (mask * loga.exp() * (loga - logp)).sum(-1)
    return head + s * topk_tail(estimator, form, logp_tok, loga_tok, in_q)
