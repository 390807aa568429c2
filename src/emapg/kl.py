"""Token-level KL estimators of EMA-PG (docs/METHOD.md section 3).

Notation at one position: ``p`` is the sampled token, drawn from ``pi_samp``; ``sg`` is stop-gradient;
``r = pi(p) / sg(pi(p))`` (value 1, gradient grad log pi(p)); ``w = anchor(p) / pi(p)``;
``s = sg(pi(p) / pi_samp(p))`` the importance weight (1 on-policy), optionally clipped from above.

Two forms of the same estimators live here:

* the **reference form**, :func:`token_kl`, on full ``[..., V]`` logits: easy to read and to test;
* the **lean form**, :func:`kl_from_logprobs`, on gathered log-probabilities (the sampled token's
  and those of the ``k`` top-k ids) computed chunk by chunk by :mod:`emapg.models.lm`; it never needs
  a ``[positions, V]`` tensor. Tests prove both give the same values and gradients.

Each estimator is declared once in :data:`ESTIMATORS` (its direction, the ids of its exact head,
its sampled term in both forms); both forms of the code, the trainer, the config validation and the
sampler's top-k choice read that declaration (:func:`emapg.algo.kl_head`, once per run). Adding an
estimator is one declaration and its tests.

A top-k estimator is a **head** and a **tail**. The head is the set of ids T whose terms are summed
exactly: the sampler's top-k, the anchor's (a distillation teacher's) top-k, or their union
(:data:`HEAD_CHOICES`; each top-k estimator declares its default). The tail, declared once in
:data:`TAILS` and named by ``form``, is what the estimate makes of the rest:

* ``unbiased`` (default): a sampled correction at the sampled token when it falls outside T; unbiased in
  value and gradient at every k (docs/METHOD.md section 3.3);
* ``paper``: the reference code's sampled tail, whose gradient is off by ``+grad pi(T)`` (reverse) and
  ``-grad pi(T)`` (forward) for ``0 < k < V`` (section 3.4);
* ``bucket``: the K+1 "bucket" KL, the tail's mass as one more outcome; no sampling, a lower bound;
* ``residual``: the bucket plus a sampled estimate of the tail's conditional KL; unbiased in value and
  gradient (the chain rule);
* ``renormalised``: the KL between both distributions renormalised over T; no tail term at all;
* ``truncated``: the head's terms alone.

Section 3.5 of docs/METHOD.md states each tail's bias as a formula; ``tests/test_kl.py`` proves it by
enumerating the sampled token, for every head and tail, on- and off-policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

HEADS = ("none", "sampler", "anchor", "all")
"""An estimator's declared head: none (purely sampled), pi_samp's top-k, the anchor's (teacher's) top-k, every id."""
HEAD_CHOICES = ("sampler", "anchor", "union")
"""The head a top-k estimator may be given (``algo.head``): pi_samp's top-k ids, the anchor's, or both sets."""
Term = Callable[[Tensor, Tensor], Tensor]
TailTerm = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""A tail's sampled term at a token p outside the head:
``(log pi(p), log anchor(p), log pi(T^c), log anchor(T^c)) -> [...]``, before the importance weight."""


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
    binds: where the estimator's own clamp binds, ``(log pi(p), log anchor(p)) -> bool [...]`` (a
        diagnostic: the fraction of tokens logged); None for an estimator without a clamp.
    """

    name: str
    direction: str
    head: str
    sample: Term | None
    paper: Term | None = None
    binds: Term | None = None

    def __post_init__(self):
        if self.head not in HEADS or self.direction not in ("reverse", "forward"):
            raise ValueError(f"estimator {self.name}: head must be one of {HEADS}, direction reverse or forward")

    @property
    def topk(self) -> bool:
        """Whether this is a top-k estimator: a head of k ids and a tail (:data:`TAILS`)."""
        return self.head in ("sampler", "anchor")

    @property
    def default_head(self) -> str | None:
        """The head a top-k estimator takes unless told (``sampler`` or ``anchor``); None otherwise."""
        return self.head if self.topk else None

    def forms(self) -> tuple[str, ...]:
        """The forms this estimator is defined in: every tail for a top-k one, else unbiased and paper
        (the same term unless the estimator declares a paper form)."""
        return tuple(TAILS) if self.topk else ("unbiased", "paper")

    def form_error(self, form: str) -> str | None:
        """Why ``form`` is not one of this estimator's forms (None when it is): the message the config, the
        TRL plug-in and both code forms give."""
        if form not in TAILS:
            return f"unknown KL form {form!r}; expected one of {', '.join(TAILS)}"
        if form not in self.forms():
            return f"{form!r} is a top-k estimator's tail; {self.name} is defined in {', '.join(self.forms())}"
        return None

    def term(self, form: str) -> Term | None:
        """The sampled term of a sampled or exact estimator in form ``"unbiased"`` or ``"paper"``."""
        if (error := self.form_error(form)) is not None:
            raise ValueError(error)
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


LOW_VAR_LOG_W, LOW_VAR_VALUE = 20.0, 10.0
"""verl's low_var_kl bounds: log w to [-20, 20], the value to [-10, 10]."""


def _low_var_kl(lp: Tensor, la: Tensor) -> Tensor:
    """verl's ``low_var_kl``: k3 with log w clamped to [-20, 20] and the value to [-10, 10]; k3 itself
    wherever w - 1 - log w <= 10 (|log w| up to about 2.4 below, 11 above), there the gradient is the
    forward KL's; beyond it the clamp holds the value and zeroes the gradient."""
    log_w = (la - lp).clamp(-LOW_VAR_LOG_W, LOW_VAR_LOG_W)
    return (torch.exp(log_w) - 1 - log_w).clamp(-LOW_VAR_VALUE, LOW_VAR_VALUE)


def _low_var_binds(lp: Tensor, la: Tensor) -> Tensor:
    """Where ``low_var_kl``'s bounds bind: |log w| over 20, or the value at its cap of 10."""
    return ((la - lp).abs() > LOW_VAR_LOG_W) | (_low_var_kl(lp, la) >= LOW_VAR_VALUE)


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


def _topk_reverse_tail(lp: Tensor, la: Tensor, lpo: Tensor, lao: Tensor) -> Tensor:
    """r sg(log pi/anchor) + (r - 1): the (r - 1) has value 0, and its expected gradient cancels the
    head weights' grad pi(q) that the paper's form leaves in (docs/METHOD.md section 3.4)."""
    r = _ratio(lp)
    return r * (lp - la).detach() + (r - 1)


def _topk_reverse_tail_paper(lp: Tensor, la: Tensor, lpo: Tensor, lao: Tensor) -> Tensor:
    r = _ratio(lp)
    return r * (lp - la).detach()


def _topk_forward_tail(lp: Tensor, la: Tensor, lpo: Tensor, lao: Tensor) -> Tensor:
    log_w = la - lp
    return torch.exp(log_w).detach() * log_w


def _topk_forward_tail_paper(lp: Tensor, la: Tensor, lpo: Tensor, lao: Tensor) -> Tensor:
    """Adds log r, zero-mean only over the whole vocabulary: biased for 0 < k < V."""
    log_w = la - lp
    return torch.exp(log_w).detach() * log_w + torch.log(_ratio(lp))


def _out(mass: Tensor) -> Tensor:
    """1 - mass, the tail's mass, kept > 0 (a head holding all the mass in floating point)."""
    return (1 - mass).clamp(min=torch.finfo(mass.dtype).tiny)


def _head_only(head: Tensor, a_in: Tensor, b_in: Tensor) -> Tensor:
    return head


def _bucket(head: Tensor, a_in: Tensor, b_in: Tensor) -> Tensor:
    """head + a(T^c) log(a(T^c) / b(T^c)): the tail as one outcome (the K+1 bucket)."""
    a_out, b_out = _out(a_in), _out(b_in)
    return head + a_out * (torch.log(a_out) - torch.log(b_out))


def _renormalised(head: Tensor, a_in: Tensor, b_in: Tensor) -> Tensor:
    """KL(a_T || b_T) of both renormalised over T: head / a(T) - log(a(T) / b(T)); 0 for an empty head."""
    some = a_in > 0
    a_safe, b_safe = torch.where(some, a_in, 1.0), torch.where(some, b_in, 1.0)
    return torch.where(some, head / a_safe - (torch.log(a_safe) - torch.log(b_safe)), 0.0)


def _residual_reverse(lp: Tensor, la: Tensor, lpo: Tensor, lao: Tensor) -> Tensor:
    """r sg(log pi(p|T^c) / anchor(p|T^c)): estimates pi(T^c) KL(pi(.|T^c) || anchor(.|T^c)) in value and
    gradient (the score is log pi(p)'s, not the conditional's: docs/METHOD.md section 3.5)."""
    return _ratio(lp) * ((lp - lpo) - (la - lao)).detach()


def _residual_forward(lp: Tensor, la: Tensor, lpo: Tensor, lao: Tensor) -> Tensor:
    """sg(w) log(anchor(p|T^c) / pi(p|T^c)): estimates anchor(T^c) KL(anchor(.|T^c) || pi(.|T^c)), its
    gradient through log pi(p) and log pi(T^c)."""
    return torch.exp(la - lp).detach() * ((la - lao) - (lp - lpo))


@dataclass(frozen=True)
class Tail:
    """What a top-k estimator makes of the ids outside its head T, declared once.

    Written for a direction's pair (a, b): the reverse KL(pi || anchor) has a = pi, b = anchor; the
    forward KL(anchor || pi) a = anchor, b = pi. ``head`` = sum over T of a log(a / b).

    combine: ``(head, a(T), b(T)) -> [...]``, the estimate's deterministic part.
    sample: per direction, the sampled term at a token outside T (:data:`TailTerm`), weighted by the
        importance weight s; None for a tail that samples nothing.
    unbiased: whether its expectation equals the KL and its gradient at every k.
    """

    name: str
    combine: Callable[[Tensor, Tensor, Tensor], Tensor]
    sample: dict[str, TailTerm] | None = None
    unbiased: bool = False


TAILS: dict[str, Tail] = {t.name: t for t in (
    Tail("unbiased", _head_only, {"reverse": _topk_reverse_tail, "forward": _topk_forward_tail}, True),
    Tail("paper", _head_only, {"reverse": _topk_reverse_tail_paper, "forward": _topk_forward_tail_paper}),
    Tail("bucket", _bucket),
    Tail("residual", _bucket, {"reverse": _residual_reverse, "forward": _residual_forward}, True),
    Tail("renormalised", _renormalised),
    Tail("truncated", _head_only),
)}
FORMS = tuple(TAILS)
"""The forms emapg ships: its tails (a sampled or exact estimator takes unbiased and paper). A tail
registered later is in :data:`TAILS`, not here."""


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("k1", "reverse", "none", _k1),
    Estimator("k2", "reverse", "none", _k2),
    Estimator("k3", "reverse", "none", _k3),
    Estimator("low_var_kl", "reverse", "none", _low_var_kl, binds=_low_var_binds),
    Estimator("k3pp", "reverse", "none", _k3pp),
    Estimator("k4", "reverse", "none", _k4),
    Estimator("k5", "forward", "none", _k5),
    Estimator("exact_reverse", "reverse", "all", None),
    Estimator("exact_forward", "forward", "all", None),
    Estimator("topk_reverse", "reverse", "sampler", None),  # its tails: TAILS
    Estimator("topk_forward", "forward", "anchor", None),
)}


def register_estimator(est: Estimator) -> Estimator:
    """Add an estimator from your own module (before a config names it): ``algo.kl``, both code forms, the
    trainer and the TRL plug-in take it at once. Its proofs are yours: ``tests/test_kl.py`` shows how."""
    if est.name in ESTIMATORS:
        raise ValueError(f"a KL estimator named {est.name!r} exists already")
    ESTIMATORS[est.name] = est
    return est


def register_tail(tail: Tail) -> Tail:
    """Add a top-k estimator's tail from your own module: ``algo.form`` and both code forms take it at once."""
    if tail.name in TAILS:
        raise ValueError(f"a tail named {tail.name!r} exists already")
    if tail.sample is not None and set(tail.sample) != {"reverse", "forward"}:
        raise ValueError(f"tail {tail.name!r}: its sampled term needs both directions, reverse and forward")
    TAILS[tail.name] = tail
    return tail


def estimator_named(name: str) -> Estimator:
    """The declaration of estimator ``name``; a ValueError lists the known ones."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def clamp_binds(name: str, policy_logp_tok: Tensor, anchor_logp_tok: Tensor, samp_logp_tok: Tensor | None,
                is_clip: float | None) -> Tensor | None:
    """[...] bool: where a clamp of the estimate binds (:func:`importance_weight`'s ``is_clip`` on s, the
    estimator's own clamp that it declares as ``binds``, such as ``low_var_kl``'s bounds); None when there is no
    clamp."""
    out = None
    if is_clip is not None and samp_logp_tok is not None:
        out = torch.exp(policy_logp_tok - samp_logp_tok) > is_clip
    binds = estimator_named(name).binds
    if binds is not None:
        bound = binds(policy_logp_tok, anchor_logp_tok)
        out = bound if out is None else out | bound
    return out


def importance_weight(policy_logp_tok: Tensor, samp_logp_tok: Tensor | None, is_clip: float | None) -> Tensor:
    """s = sg(pi(p) / pi_samp(p)), clipped from above at ``is_clip`` when given. Shape of the inputs."""
    if samp_logp_tok is None:
        return torch.ones_like(policy_logp_tok).detach()
    s = torch.exp(policy_logp_tok.detach() - samp_logp_tok.detach())
    if is_clip is not None:
        s = s.clamp(max=is_clip)
    return s


def head_term(direction: str, policy_logp_q: Tensor, anchor_logp_q: Tensor, mask: Tensor | None = None) -> Tensor:
    """The exact head over the gathered ids q: sum_q pi (log pi - log anchor) for the reverse KL,
    sum_q anchor (log anchor - log pi) for the forward one. Inputs [..., k]; ``mask`` [..., k] (bool or
    0/1) leaves out ids that are not in the head (a union's repeated ids); returns [...]."""
    if direction == "reverse":
        terms = policy_logp_q.exp() * (policy_logp_q - anchor_logp_q)
    else:
        terms = anchor_logp_q.exp() * (anchor_logp_q - policy_logp_q)
    return (terms if mask is None else terms * mask).sum(-1)


def head_masses(policy_logp_q: Tensor, anchor_logp_q: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """pi(T) and anchor(T), the head's mass under each, from the gathered log-probs [..., k]."""
    pi, an = policy_logp_q.exp(), anchor_logp_q.exp()
    if mask is not None:
        pi, an = pi * mask, an * mask
    return pi.sum(-1), an.sum(-1)


def in_head(head_ids: Tensor, tokens: Tensor) -> Tensor:
    """[...] bool: whether the sampled token is one of the head ids [..., k]."""
    return (head_ids == tokens.unsqueeze(-1)).any(-1)


def topk_estimate(est: Estimator, form: str, head: Tensor, pi_in: Tensor, an_in: Tensor, logp_tok: Tensor,
                  loga_tok: Tensor, s: Tensor, outside: Tensor) -> Tensor:
    """A top-k estimator's value from its head sum, the head's masses and the sampled token: the tail
    ``form`` (:data:`TAILS`) combines them. Both forms of the code end here."""
    if form not in TAILS:
        raise ValueError(f"unknown KL form {form!r}; expected one of {', '.join(TAILS)}")
    tail = TAILS[form]
    a_in, b_in = (pi_in, an_in) if est.direction == "reverse" else (an_in, pi_in)
    value = tail.combine(head, a_in, b_in)
    if tail.sample is None:
        return value
    term = tail.sample[est.direction](logp_tok, loga_tok, torch.log(_out(pi_in)), torch.log(_out(an_in)))
    return value + s * (outside * term)


def kl_from_logprobs(
    name: str,
    policy_logp_tok: Tensor,
    anchor_logp_tok: Tensor,
    *,
    samp_logp_tok: Tensor | None = None,
    policy_logp_q: Tensor | None = None,
    anchor_logp_q: Tensor | None = None,
    in_q: Tensor | None = None,
    head_mask: Tensor | None = None,
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
        head_mask: [..., k] which gathered ids are in the head (None: all; a union's repeats are not).
        form: a tail of :data:`TAILS` for the top-k estimators; unbiased or paper for the others.
        With ``policy_logp_q=None`` a top-k estimator runs with k = 0 (no head, all tail).
    Returns:
        [...] the estimate, differentiable w.r.t. the policy's log-probs.
    """
    est = estimator_named(name)
    s = importance_weight(policy_logp_tok, samp_logp_tok, is_clip)
    if est.topk:
        if policy_logp_q is None or policy_logp_q.shape[-1] == 0:  # k = 0: no head, every token is tail
            zero = torch.zeros_like(policy_logp_tok)
            head, pi_in, an_in, in_q = zero, zero, zero, torch.zeros_like(policy_logp_tok, dtype=torch.bool)
        else:
            head = head_term(est.direction, policy_logp_q, anchor_logp_q, head_mask)
            pi_in, an_in = head_masses(policy_logp_q, anchor_logp_q, head_mask)
        outside = (~in_q).to(policy_logp_tok.dtype)
        return topk_estimate(est, form, head, pi_in, an_in, policy_logp_tok, anchor_logp_tok, s, outside)
    term = est.term(form)
    if term is None:  # exact: the head is every id
        return head_term(est.direction, policy_logp_q, anchor_logp_q)
    return s * term(policy_logp_tok, anchor_logp_tok)


def head_ids(name: str, k: int, samp_logits: Tensor, anchor_logits: Tensor) -> Tensor:
    """The head ids q from full logits: top-k of pi_samp or of the anchor, as the estimator declares
    (every id for the exact ones). Returns [..., k] long."""
    est = estimator_named(name)
    if est.topk:
        return choose_head(est.default_head, k, samp_logits, anchor_logits)[0]
    k = samp_logits.shape[-1] if est.head == "all" else min(k, samp_logits.shape[-1])
    return samp_logits.detach().topk(k, dim=-1).indices


def union_mask(sampler_ids: Tensor, anchor_ids: Tensor) -> tuple[Tensor, Tensor]:
    """The union of two head id sets as ``(ids, mask)``: ``ids`` [..., k1 + k2] the sampler's ids then the
    anchor's, ``mask`` False where an anchor id repeats a sampler id (counted once)."""
    repeat = (anchor_ids.unsqueeze(-1) == sampler_ids.unsqueeze(-2)).any(-1)
    mask = torch.cat([torch.ones_like(sampler_ids, dtype=torch.bool), ~repeat], -1)
    return torch.cat([sampler_ids, anchor_ids], -1), mask


def choose_head(choice: str, k: int, samp_logits: Tensor, anchor_logits: Tensor) -> tuple[Tensor, Tensor | None]:
    """The head ids of a top-k estimator from full logits, by :data:`HEAD_CHOICES`: ``(ids, mask)``
    (mask None unless a union)."""
    if choice not in HEAD_CHOICES:
        raise ValueError(f"unknown head {choice!r}; expected one of {', '.join(HEAD_CHOICES)}")
    k = min(k, samp_logits.shape[-1])
    top = lambda logits: logits.detach().topk(k, dim=-1).indices  # noqa: E731
    if choice == "union":
        return union_mask(top(samp_logits), top(anchor_logits))
    return top(samp_logits if choice == "sampler" else anchor_logits), None


def token_kl(
    policy_logits: Tensor,
    anchor_logits: Tensor,
    tokens: Tensor,
    *,
    estimator: str = "topk_reverse",
    k: int = 32,
    sampling_logits: Tensor | None = None,
    form: str = "unbiased",
    head: str | None = None,
    is_clip: float | None = None,
) -> Tensor:
    """Reference form: the per-position KL estimate from full logits.

    Args:
        policy_logits, anchor_logits, sampling_logits: [..., V], already at the sampling
            temperature. ``sampling_logits=None`` means on-policy: pi_samp = sg(pi_theta).
        tokens: [...] the sampled token at each position.
        estimator: one of :data:`ESTIMATORS`. k: head size for the top-k estimators (0..V).
        form: a tail of :data:`TAILS` (top-k) or unbiased/paper. head: a top-k estimator's head
            (:data:`HEAD_CHOICES`; None: the one it declares). is_clip: clip s from above.
    Returns:
        [...] the estimate, differentiable w.r.t. ``policy_logits``.

    The head and its masses are written over the whole vocabulary with a 0/1 mask (no gather), so they
    are an independent computation from :func:`kl_from_logprobs`, which tests compare it with.
    """
    est = estimator_named(estimator)
    logp = torch.log_softmax(policy_logits, -1)
    loga = torch.log_softmax(anchor_logits.detach(), -1)
    if head is not None and not est.topk:
        raise ValueError(f"head={head!r}: {estimator} is not a top-k estimator")
    mask = torch.zeros_like(logp)
    if est.head == "all":
        mask = torch.ones_like(logp)
    elif est.topk and k > 0:
        samp = policy_logits if sampling_logits is None else sampling_logits
        ids, _ = choose_head(head or est.default_head, k, samp, anchor_logits)
        mask.scatter_(-1, ids, 1.0)  # a union's repeated id sets the same 1
    # the head, written over the whole vocabulary with the 0/1 mask
    if est.direction == "reverse":
        head_sum = (mask * logp.exp() * (logp - loga)).sum(-1)
    else:
        head_sum = (mask * loga.exp() * (loga - logp)).sum(-1)
    tokens = tokens.unsqueeze(-1)
    logp_tok = logp.gather(-1, tokens).squeeze(-1)
    loga_tok = loga.gather(-1, tokens).squeeze(-1)
    samp_logp_tok = None
    if sampling_logits is not None:
        samp_logp_tok = torch.log_softmax(sampling_logits.detach(), -1).gather(-1, tokens).squeeze(-1)
    s = importance_weight(logp_tok, samp_logp_tok, is_clip)
    outside = 1.0 - mask.gather(-1, tokens).squeeze(-1)
    if est.topk:
        pi_in, an_in = (mask * logp.exp()).sum(-1), (mask * loga.exp()).sum(-1)
        return topk_estimate(est, form, head_sum, pi_in, an_in, logp_tok, loga_tok, s, outside)
    term = est.term(form)
    if term is None:
        return head_sum
    return s * term(logp_tok, loga_tok)
