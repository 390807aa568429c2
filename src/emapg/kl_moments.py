"""Exact moments of the KL estimators over the sampled token at one position, in O(V).

At a position with policy logits z (log-probs lp = log_softmax(z)), anchor log-probs la and the
token p drawn from pi_samp = pi (on-policy), every estimator of :mod:`emapg.kl` is

    f(p) = C(lp) + [p not in T] * term(lp_p, la_p, lpo)

(C the deterministic part: a top-k estimator's head combined by its tail, the exact sum, or nothing for
the sampled estimators; T the head; lpo = log pi(T^c), which only the residual tail reads). Its gradient
in z is then, since d lp_v / d z = e_v - pi,

    g(p) = D + [p not in T] (c_p (e_p - pi) + gamma_p U),

with D and U the z-gradients of C and lpo (D = d - (sum d) pi for d = dC/dlp), c = d term / d lp_p and
gamma = d term / d lpo. The expected value, the expected gradient and the gradient's variance
E||g - E g||^2 over p follow in closed form from these V numbers (computed with autograd, so every
estimator's stop-gradients count exactly as in training): with c~ = c [v not in T], gamma~ likewise,

    E g   = D + pi * c~ - (pi . c~) pi + (pi . gamma~) U
    Var g = sum_p pi_p ||h_p||^2 - ||E g - D||^2,   h_p = c~_p (e_p - pi) + gamma~_p U,
    ||h_p||^2 = c~_p^2 (1 - 2 pi_p + ||pi||^2) + 2 c~_p gamma~_p (U_p - pi . U) + gamma~_p^2 ||U||^2

``tests/test_kl_moments.py`` checks these against enumerating every token with autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from emapg import kl


@dataclass
class Moments:
    """Over the sampled token at one position: the estimator's expected value and its variance, its
    expected gradient in the policy logits [V] and the gradient's variance (a number)."""

    value: float
    value_var: float
    grad: Tensor
    grad_var: float


def exact_kl(policy_logits: Tensor, anchor_logits: Tensor, direction: str) -> tuple[float, Tensor]:
    """KL(pi || anchor) (reverse) or KL(anchor || pi) (forward) and its gradient in the policy logits."""
    z = policy_logits.detach().double().requires_grad_(True)
    lp, la = torch.log_softmax(z, -1), torch.log_softmax(anchor_logits.double(), -1)
    value = (lp.exp() * (lp - la)).sum() if direction == "reverse" else (la.exp() * (la - lp)).sum()
    (grad,) = torch.autograd.grad(value, z)
    return float(value.detach()), grad


def head_ids(name: str, k: int, policy_logits: Tensor, anchor_logits: Tensor, head: str | None = None) -> Tensor:
    """The estimator's head ids at this position: pi_samp's (= pi's) top-k, the anchor's, or both (a
    union's repeats removed); every id for the exact estimators."""
    est = kl.estimator_named(name)
    if not est.topk:
        return kl.head_ids(name, k, policy_logits, anchor_logits)
    ids, mask = kl.choose_head(head or est.default_head, k, policy_logits, anchor_logits)
    return ids if mask is None else ids[mask]


def moments(name: str, policy_logits: Tensor, anchor_logits: Tensor, *, k: int = 0, form: str = "unbiased",
            head: str | None = None) -> Moments:
    """Exact moments of estimator ``name`` (in ``form``, with ``head`` for a top-k one) over p ~ pi at one
    position (logits [V])."""
    est = kl.estimator_named(name)
    if (error := est.form_error(form)) is not None:
        raise ValueError(error)
    lp0 = torch.log_softmax(policy_logits.detach().double(), -1)
    la = torch.log_softmax(anchor_logits.detach().double(), -1)
    pi = lp0.exp()
    v = lp0.shape[-1]
    outside = torch.ones(v, dtype=torch.float64)
    lp = lp0.clone().requires_grad_(True)
    zero = lp.sum() * 0.0
    q = None
    if est.head == "all" or (est.topk and k > 0):
        q = head_ids(name, k, policy_logits, anchor_logits, head)
        outside[q] = 0.0
    # the deterministic part C(lp) and log pi(T^c) as functions of lp
    if est.topk:
        h = kl.head_term(est.direction, lp[q], la[q]) if q is not None else zero
        pi_in, an_in = kl.head_masses(lp[q], la[q]) if q is not None else (zero, zero)
        a_in, b_in = (pi_in, an_in) if est.direction == "reverse" else (an_in, pi_in)
        c_part = kl.TAILS[form].combine(h, a_in, b_in)
        lpo, lao = torch.log(kl._out(pi_in)), torch.log(kl._out(an_in.detach()))
        tail_term = kl.TAILS[form].sample
        term = None if tail_term is None else tail_term[est.direction]
    else:
        c_part = kl.head_term(est.direction, lp[q], la[q]) if q is not None else zero
        lpo, lao = zero, zero
        plain = est.term(form)
        term = None if plain is None else (lambda a, b, _o, _p, f=plain: f(a, b))
    d = torch.autograd.grad(c_part, lp, retain_graph=True, allow_unused=True)[0]
    d = torch.zeros(v, dtype=torch.float64) if d is None else d
    u = torch.autograd.grad(lpo, lp, allow_unused=True)[0] if lpo.requires_grad else None
    u = torch.zeros(v, dtype=torch.float64) if u is None else u
    c = torch.zeros(v, dtype=torch.float64)
    gamma = torch.zeros(v, dtype=torch.float64)
    f = torch.zeros(v, dtype=torch.float64)
    if term is not None:
        lp_each = lp0.clone().requires_grad_(True)
        lpo_each = lpo.detach().expand(v).clone().requires_grad_(True)  # one copy per sampled id: gamma_v apart
        values = term(lp_each, la, lpo_each, lao.detach())  # elementwise: the term as if each id were sampled
        c, gamma = torch.autograd.grad(values.sum(), (lp_each, lpo_each), allow_unused=True)
        c = torch.zeros(v, dtype=torch.float64) if c is None else c * outside
        gamma = torch.zeros(v, dtype=torch.float64) if gamma is None else gamma * outside
        f = values.detach() * outside
    big_d = d - d.sum() * pi
    big_u = u - u.sum() * pi
    m = pi * c - (pi @ c) * pi + (pi @ gamma) * big_u
    grad = big_d + m
    second = ((pi * c**2 * (1 - 2 * pi + (pi @ pi))).sum() + 2 * (pi * c * gamma * (big_u - pi @ big_u)).sum()
              + (big_u @ big_u) * (pi * gamma**2).sum())
    grad_var = float(second - m @ m)
    value = float(c_part.detach()) + float(pi @ f)
    value_var = float(pi @ f**2 - (pi @ f) ** 2)
    return Moments(value=value, value_var=max(value_var, 0.0), grad=grad, grad_var=max(grad_var, 0.0))
