"""The closed-form moments of emapg.kl_moments equal enumerating every sampled token with autograd
through the reference form kl.token_kl, for every estimator, form and k."""

from __future__ import annotations

import pytest
import torch

from emapg import kl
from emapg.kl_moments import exact_kl, moments

V = 12
CASES = [(name, form, head, k) for name, est in kl.ESTIMATORS.items()
         for form in (est.forms() if est.topk else ("unbiased", "paper") if est.paper else ("unbiased",))
         for head in (kl.HEAD_CHOICES if est.topk else (None,))
         for k in ((0, 1, 4, V - 1) if est.topk else (0,))]


def enumerate_moments(name, form, head, k, policy, anchor):
    pi = torch.softmax(policy, -1)
    values, grads = [], []
    for p in range(V):
        z = policy.clone().requires_grad_(True)
        f = kl.token_kl(z, anchor, torch.tensor(p), estimator=name, k=k, form=form, head=head)
        (g,) = torch.autograd.grad(f, z)
        values.append(float(f))
        grads.append(g)
    values, grads = torch.tensor(values, dtype=torch.float64), torch.stack(grads)
    mean_g = pi @ grads
    return (float(pi @ values), float(pi @ values**2 - (pi @ values) ** 2), mean_g,
            float(pi @ ((grads - mean_g) ** 2).sum(-1)))


@pytest.mark.parametrize("name,form,head,k", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_moments_equal_enumeration(name, form, head, k, seed):
    g = torch.Generator().manual_seed(seed)
    policy = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    anchor = policy + 0.7 * torch.randn(V, generator=g, dtype=torch.float64)
    m = moments(name, policy, anchor, k=k, form=form, head=head)
    value, value_var, grad, grad_var = enumerate_moments(name, form, head, k, policy, anchor)
    assert m.value == pytest.approx(value, rel=1e-9, abs=1e-12)
    assert m.value_var == pytest.approx(value_var, rel=1e-7, abs=1e-12)
    torch.testing.assert_close(m.grad, grad, rtol=1e-9, atol=1e-12)
    assert m.grad_var == pytest.approx(grad_var, rel=1e-7, abs=1e-12)


def test_the_unbiased_estimators_are_unbiased_and_the_paper_form_is_not():
    g = torch.Generator().manual_seed(3)
    policy = torch.randn(V, generator=g, dtype=torch.float64)
    anchor = policy + 0.5 * torch.randn(V, generator=g, dtype=torch.float64)
    for name, direction in (("topk_reverse", "reverse"), ("topk_forward", "forward")):
        value, grad = exact_kl(policy, anchor, direction)
        m = moments(name, policy, anchor, k=4)
        assert m.value == pytest.approx(value, rel=1e-10)
        torch.testing.assert_close(m.grad, grad, rtol=1e-9, atol=1e-12)
        paper = moments(name, policy, anchor, k=4, form="paper")
        assert float((paper.grad - grad).norm()) > 1e-3
