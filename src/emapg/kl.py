"""Token-level KL estimators of EMA-PG (docs/METHOD.md section 3).

Notation at one position: ``p`` is the sampled token, drawn from ``pi_samp``; ``sg`` is stop-gradient;
``r = pi(p) / sg(pi(p))`` (value 1, gradient grad log pi(p)); ``w = anchor(p) / pi(p)``;
``s = sg(pi(p) / pi_samp(p))`` the importance weight (1 on-policy), optionally clipped from above.

Two forms of the same estimators live here:

* the **reference form**, :func:`token_kl`, on full ``[..., V]`` logits: easy to read and to test;
* the **lean form**, :func:`kl_from_logprobs`, on gathered log-probabilities (the sampled token's
  and those of the ``k`` top-k ids) computed chunk by chunk by :mod:`emapg.logprobs`; it never needs
  a ``[positions, V]`` tensor. Tests prove both give the same values and gradients.

Each estimator is declared once in :data:`ESTIMATORS` (its direction, the ids of its exact head,
its sampled term in both forms); both forms of the code, the trainer, the config validation and the
sampler's top-k choice read that declaration (:func:`emapg.algo.kl_head`, once per run). Adding an
estimator is one declaration and its tests.

``form="unbiased"`` (default) is the corrected top-k estimator; ``form="paper"`` reproduces the
reference code's formulas, whose gradient is off by ``+grad pi(q)`` (reverse) and ``-grad pi(q)``
(forward) for ``0 < k < V``. docs/METHOD.md section 3.4 explains why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

FORMS = ("unbiased", "paper")
HEADS = ("none", "sampler_topk", "anchor_topk", "all")
Term = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Estimator:
    """One KL estimator, declared once: everything the rest of the code asks about it.

    direction: ``"reverse"`` estimates KL(pi || anchor), ``"forward"`` KL(anchor || pi).
    head: the ids whose terms are summed exactly: ``none`` (a purely sampled estimator), the
        sampler's top-k (recorded at sampling time), the anchor's own top-k (found in the anchor
        pass), or every id (the exact KL).
    sample: the sampled term at the token p, ``(log pi(p), log anchor(p)) -> [...]``, before the
        importance weight s; for a top-k estimator it counts only where p is outside the head.
        None for the exact estimators.
    paper: the paper's form of the sampled term, where it differs (the top-k estimators); None =
        the same as ``sample``.
    """

    name: str
    direction: str
    head: str
    sample: Term | None
    paper: Term | None = None

    def __post_init__(self):
        if self.head not in HEADS or self.direction not in ("reverse", "forward"):
            raise ValueError(f"estimator {self.name}: head must be one of {HEADS}, direction reverse or forward")

    def term(self, form: str) -> Term | None:
        """The sampled term in form ``"unbiased"`` or ``"paper"``."""
        if form not in FORMS:
            raise ValueError(f"unknown KL form {form!r}; expected one of {', '.join(FORMS)}")
        return self.paper if form == "paper" and self.paper is not None else self.sample


def _ratio(logp: Tensor) -> Tensor:
    """r = pi / sg(pi): value exactly 1, gradient grad log pi."""
    return torch.exp(logp - logp.detach())


def _k1(lp: Tensor, la: Tensor) -> Tensor:
    """log pi/anchor: unbiased value of the reverse KL, zero expected gradient."""
    log_w = la - lp
    return -log_w


def _k2(lp: Tensor, la: Tensor) -> Tensor:
    """(log w)^2 / 2: biased value, its gradient is the reverse KL's on-policy."""
    log_w = la - lp
    return 0.5 * log_w**2


def _k3(lp: Tensor, la: Tensor) -> Tensor:
    """w - 1 - log w: unbiased reverse-KL value, but its gradient is the forward KL's."""
    log_w = la - lp
    return torch.exp(log_w) - 1 - log_w


def _low_var_kl(lp: Tensor, la: Tensor) -> Tensor:
    """verl's ``low_var_kl``: k3 with log w clamped to [-20, 20] and the value to [-10, 10]; k3 itself
    wherever w - 1 - log w <= 10 (|log w| up to about 2.4 below, 11 above), there the gradient is the
    forward KL's; beyond it the clamp holds the value and zeroes the gradient."""
    log_w = (la - lp).clamp(-20.0, 20.0)
    return (torch.exp(log_w) - 1 - log_w).clamp(-10.0, 10.0)


def _k3pp(lp: Tensor, la: Tensor) -> Tensor:
    """r (w - 1 - log w): k3's value with the reverse KL's gradient."""
    log_w = la - lp
    return _ratio(lp) * (torch.exp(log_w) - 1 - log_w)


def _k4(lp: Tensor, la: Tensor) -> Tensor:
    """r sg(log pi/anchor): the reverse KL's value and gradient (REINFORCE form)."""
    log_w = la - lp
    return _ratio(lp) * (-log_w).detach()


def _k5(lp: Tensor, la: Tensor) -> Tensor:
    """sg(w) log w + log r: the forward KL's value and gradient."""
    log_w = la - lp
    return torch.exp(log_w).detach() * log_w + torch.log(_ratio(lp))


def _topk_reverse_tail(lp: Tensor, la: Tensor) -> Tensor:
    """r sg(log pi/anchor) + (r - 1): the (r - 1) has value 0, and its expected gradient cancels the
    head weights' grad pi(q) that the paper's form leaves in (docs/METHOD.md section 3.4)."""
    r = _ratio(lp)
    return r * (lp - la).detach() + (r - 1)


def _topk_reverse_tail_paper(lp: Tensor, la: Tensor) -> Tensor:
    r = _ratio(lp)
    return r * (lp - la).detach()


def _topk_forward_tail(lp: Tensor, la: Tensor) -> Tensor:
    log_w = la - lp
    return torch.exp(log_w).detach() * log_w


def _topk_forward_tail_paper(lp: Tensor, la: Tensor) -> Tensor:
    """Adds log r, zero-mean only over the whole vocabulary: biased for 0 < k < V."""
    log_w = la - lp
    return torch.exp(log_w).detach() * log_w + torch.log(_ratio(lp))


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("k1", "reverse", "none", _k1),
    Estimator("k2", "reverse", "none", _k2),
    Estimator("k3", "reverse", "none", _k3),
    Estimator("low_var_kl", "reverse", "none", _low_var_kl),
    Estimator("k3pp", "reverse", "none", _k3pp),
    Estimator("k4", "reverse", "none", _k4),
    Estimator("k5", "forward", "none", _k5),
    Estimator("exact_reverse", "reverse", "all", None),
    Estimator("exact_forward", "forward", "all", None),
    Estimator("topk_reverse", "reverse", "sampler_topk", _topk_reverse_tail, _topk_reverse_tail_paper),
    Estimator("topk_forward", "forward", "anchor_topk", _topk_forward_tail, _topk_forward_tail_paper),
)}


def estimator(name: str) -> Estimator:
    """The declaration of estimator ``name``; a ValueError lists the known ones."""
    return _declared(name)


def _declared(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def importance_weight(policy_logp_tok: Tensor, samp_logp_tok: Tensor | None, is_clip: float | None) -> Tensor:
    """s = sg(pi(p) / pi_samp(p)), clipped from above at ``is_clip`` when given. Shape of the inputs."""
    if samp_logp_tok is None:
        return torch.ones_like(policy_logp_tok).detach()
    s = torch.exp(policy_logp_tok.detach() - samp_logp_tok.detach())
    if is_clip is not None:
        s = s.clamp(max=is_clip)
    return s


def head_term(direction: str, policy_logp_q: Tensor, anchor_logp_q: Tensor) -> Tensor:
    """The exact head over the gathered ids q: sum_q pi (log pi - log anchor) for the reverse KL,
    sum_q anchor (log anchor - log pi) for the forward one. Inputs [..., k]; returns [...]."""
    if direction == "reverse":
        return (policy_logp_q.exp() * (policy_logp_q - anchor_logp_q)).sum(-1)
    return (anchor_logp_q.exp() * (anchor_logp_q - policy_logp_q)).sum(-1)


def in_head(head_ids: Tensor, tokens: Tensor) -> Tensor:
    """[...] bool: whether the sampled token is one of the head ids [..., k]."""
    return (head_ids == tokens.unsqueeze(-1)).any(-1)


def kl_from_logprobs(
    name: str,
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
        in_q: [...] bool, sampled token in q (top-k estimators only, see :func:`in_head`).
        With ``policy_logp_q=None`` a top-k estimator runs with k = 0 (no head, all tail).
    Returns:
        [...] the estimate, differentiable w.r.t. the policy's log-probs.
    """
    est = estimator(name)
    term = est.term(form)
    if term is None:  # exact: the head is every id
        return head_term(est.direction, policy_logp_q, anchor_logp_q)
    s = importance_weight(policy_logp_tok, samp_logp_tok, is_clip)
    if est.head == "none":
        return s * term(policy_logp_tok, anchor_logp_tok)
    if policy_logp_q is None or policy_logp_q.shape[-1] == 0:  # k = 0: no head, every token is tail
        head = torch.zeros_like(policy_logp_tok)
        in_q = torch.zeros_like(policy_logp_tok, dtype=torch.bool)
    else:
        head = head_term(est.direction, policy_logp_q, anchor_logp_q)
    outside = (~in_q).to(policy_logp_tok.dtype)
    return head + s * (outside * term(policy_logp_tok, anchor_logp_tok))


def head_ids(name: str, k: int, samp_logits: Tensor, anchor_logits: Tensor) -> Tensor:
    """The head ids q from full logits: top-k of pi_samp or of the anchor, as the estimator declares
    (every id for the exact ones). Returns [..., k] long."""
    est = estimator(name)
    source = anchor_logits if est.head == "anchor_topk" else samp_logits
    k = source.shape[-1] if est.head == "all" else min(k, source.shape[-1])
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
    est = _declared(estimator)
    term = est.term(form)
    logp = torch.log_softmax(policy_logits, -1)
    loga = torch.log_softmax(anchor_logits.detach(), -1)
    mask = torch.zeros_like(logp)
    if est.head == "all":
        mask = torch.ones_like(logp)
    elif est.head != "none" and k > 0:
        samp = policy_logits if sampling_logits is None else sampling_logits
        mask.scatter_(-1, head_ids(estimator, k, samp, anchor_logits), 1.0)
    # the head, written over the whole vocabulary with the 0/1 mask
    if est.direction == "reverse":
        head = (mask * logp.exp() * (logp - loga)).sum(-1)
    else:
        head = (mask * loga.exp() * (loga - logp)).sum(-1)
    if term is None:
        return head
    tokens = tokens.unsqueeze(-1)
    logp_tok = logp.gather(-1, tokens).squeeze(-1)
    loga_tok = loga.gather(-1, tokens).squeeze(-1)
    samp_logp_tok = None
    if sampling_logits is not None:
        samp_logp_tok = torch.log_softmax(sampling_logits.detach(), -1).gather(-1, tokens).squeeze(-1)
    s = importance_weight(logp_tok, samp_logp_tok, is_clip)
    outside = 1.0 - mask.gather(-1, tokens).squeeze(-1)
    return head + s * outside * term(logp_tok, loga_tok)
