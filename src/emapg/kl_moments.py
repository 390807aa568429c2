"""Exact moments of the KL estimators over the sampled token at one position, in O(V).

At a position with policy logits z (log-probs lp = log_softmax(z)), anchor log-probs la and the
token p drawn from pi_samp = pi (on-policy), every estimator of :mod:`emapg.kl` is

    f(p) = H(lp_q) + [p not in q] * term(lp_p, la_p)

(H the exact head over the head ids q, absent for the sampled estimators; term the declared
sampled term). Its gradient in z is then, since d lp_v / d z = e_v - pi,

    g(p) = sum_v d_v (e_v - pi) + c_p [p not in q] (e_p - pi),    d = dH/dlp,  c = d term / d lp_p,

so the expected value, the expected gradient and the gradient's variance E||g - E g||^2 over p
follow in closed form from the V numbers c and d (computed with autograd, so every estimator's
stop-gradients count exactly as in training):

    E g   = D + pi * c~ - (pi . c~) pi,                     D = d - (sum d) pi,  c~ = c [v not in q]
    Var g = sum_p pi_p c~_p^2 (1 - 2 pi_p + ||pi||^2) - ||pi * c~ - (pi . c~) pi||^2

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


def head_ids(name: str, k: int, policy_logits: Tensor, anchor_logits: Tensor) -> Tensor:
    """The estimator's head ids at this position: pi_samp's (= pi's) top-k or the anchor's."""
    return kl.head_ids(name, k, policy_logits, anchor_logits)


def moments(name: str, policy_logits: Tensor, anchor_logits: Tensor, *, k: int = 0, form: str = "unbiased") -> Moments:
    """Exact moments of estimator ``name`` over p ~ pi at one position (logits [V])."""
    est = kl.estimator(name)
    est.term(form)  # an unknown form is refused here
    lp0 = torch.log_softmax(policy_logits.detach().double(), -1)
    la = torch.log_softmax(anchor_logits.detach().double(), -1)
    pi = lp0.exp()
    v = lp0.shape[-1]
    outside = torch.ones(v, dtype=torch.float64)
    head_value, d = 0.0, torch.zeros(v, dtype=torch.float64)
    if est.head != "none" and (k > 0 or est.head == "all"):
        q = head_ids(name, k, policy_logits, anchor_logits)
        outside[q] = 0.0
        lp = lp0.clone().requires_grad_(True)
        h = kl.head_term(est.direction, lp[q], la[q])
        (d,) = torch.autograd.grad(h, lp)
        head_value = float(h)
    term = est.term(form)
    c = torch.zeros(v, dtype=torch.float64)
    f = torch.zeros(v, dtype=torch.float64)
    if term is not None:
        lp = lp0.clone().requires_grad_(True)
        values = term(lp, la)  # elementwise: the term as if each id were the sampled token
        (c,) = torch.autograd.grad(values.sum(), lp)
        f = values.detach() * outside
        c = c * outside
    big_d = d - d.sum() * pi
    m = pi * c - (pi @ c) * pi
    grad = big_d + m
    grad_var = float((pi * c**2 * (1 - 2 * pi + (pi @ pi))).sum() - m @ m)
    value = head_value + float(pi @ f)
    value_var = float(pi @ f**2 - (pi @ f) ** 2)
    return Moments(value=value, value_var=max(value_var, 0.0), grad=grad, grad_var=max(grad_var, 0.0))
