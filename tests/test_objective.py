import math

import pytest
import torch

from emapg import objective as obj


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = obj.group_advantages(r, 4, "grpo")
    std = math.sqrt(0.75 / 3)  # unbiased std of [1, 0, 0, 0]: squared deviations sum to 0.75
    torch.testing.assert_close(a[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6))
    torch.testing.assert_close(a[4:], torch.zeros(4))  # all equal: no signal
    torch.testing.assert_close(obj.group_advantages(r, 4, "drgrpo")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # rloo: R_i - mean of the 3 others
    torch.testing.assert_close(obj.group_advantages(r, 4, "rloo")[:4], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    with pytest.raises(ValueError, match="groups of 3"):
        obj.group_advantages(r, 3)
    with pytest.raises(ValueError, match="unknown advantage mode"):
        obj.group_advantages(r, 4, "ppo")


def test_clipped_surrogate_hand_computed():
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.9, 5.0]]))
    old = torch.zeros(1, 4)
    out = obj.clipped_surrogate(logp, old, torch.tensor([1.0]), eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    # A > 0: loss = -min(rho, clip) ... = max(-rho, -clip(rho))
    torch.testing.assert_close(out.loss, -torch.tensor([[1.28, 0.5, 0.9, 1.28]]))
    torch.testing.assert_close(out.clipped, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    out = obj.clipped_surrogate(logp, old, torch.tensor([-2.0]), eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    # A < 0: max(2 rho, 2 clip(rho)) then capped at 2 * 3 = 6
    torch.testing.assert_close(out.loss, torch.tensor([[3.0, 1.6, 1.8, 6.0]]))
    torch.testing.assert_close(out.clipped, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(out.dual_clipped, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))
    out = obj.clipped_surrogate(logp, old, torch.tensor([-2.0]), dual_clip=None)
    assert out.loss[0, 3].item() == pytest.approx(10.0)


def test_clipped_tokens_have_zero_gradient():
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_(True)
    out = obj.clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([1.0]))
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1]]))


def test_aggregation_modes_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert obj.aggregate(v, m, "token-mean").item() == pytest.approx(10 / 4)
    assert obj.aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert obj.aggregate(v, m, "seq-mean-token-sum-norm", max_len=4).item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    with pytest.raises(ValueError, match="max_len"):
        obj.aggregate(v, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown aggregation"):
        obj.aggregate(v, m, "sum")


def test_masked_positions_contribute_nothing():
    v = torch.randn(3, 5, requires_grad=True)
    m = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 1]])
    for mode in obj.AGGREGATIONS:
        loss = obj.aggregate(v * 1e6 * (1 - m) + v, m, mode, max_len=5)  # huge values where masked
        (g,) = torch.autograd.grad(loss, v)
        assert torch.all(g[m == 0] == 0)
        v2 = v.detach().clone()
        v2[m == 0] = float("nan")  # a NaN where masked (a padded position) changes nothing
        v2[0, 2] = float("inf")
        torch.testing.assert_close(obj.aggregate(v2, m, mode, max_len=5), obj.aggregate(v.detach() * m, m, mode,
                                                                                          max_len=5))
