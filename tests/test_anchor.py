import pytest
import torch
from torch import nn

from emapg.anchor import EMAAnchor


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=dtype)
        self.register_buffer("running", torch.zeros(2, dtype=dtype))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


def test_closed_form_after_n_updates_with_every():
    torch.manual_seed(0)
    model = Tiny(torch.float64)
    theta0 = {n: t.clone() for n, t in model.state_dict().items()}
    eta, every, n_steps = 0.8, 3, 12
    anchor = EMAAnchor(model, eta=eta, every=every)
    expected = {n: t.clone() for n, t in theta0.items() if t.is_floating_point()}
    for step in range(1, n_steps + 1):
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.add_(torch.randn_like(t))
        updated = anchor.step(model)
        assert updated == (step % every == 0)
        if updated:
            for n, t in model.state_dict().items():
                if n in expected:
                    expected[n] = eta * expected[n] + (1 - eta) * t
    for n, t in anchor.module.state_dict().items():
        if n in expected:
            torch.testing.assert_close(t, expected[n], atol=1e-12, rtol=1e-12)
    assert anchor.num_updates == n_steps // every


def test_closed_form_constant_policy():
    model = Tiny(torch.float64)
    theta0 = model.lin.weight.detach().clone()
    anchor = EMAAnchor(model, eta=0.9)
    with torch.no_grad():
        model.lin.weight.fill_(2.0)
    for _ in range(7):
        anchor.step(model)
    want = 0.9**7 * theta0 + (1 - 0.9**7) * 2.0
    torch.testing.assert_close(anchor.module.lin.weight, want, atol=1e-12, rtol=0)


def test_eta_one_is_frozen_reference():
    model = Tiny()
    w0 = model.lin.weight.detach().clone()
    anchor = EMAAnchor(model, eta=1.0)
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    anchor.step(model)
    assert torch.equal(anchor.module.lin.weight, w0)


def test_fp32_average_keeps_updates_bf16_loses():
    model = Tiny(torch.bfloat16)
    with torch.no_grad():
        model.lin.weight.fill_(1.0)
    anchor = EMAAnchor(model, eta=0.999)
    with torch.no_grad():
        model.lin.weight.fill_(1.0078125)  # next bf16 value above 1
    naive = model.lin.weight.detach().clone().fill_(1.0)
    for _ in range(100):
        anchor.step(model)
        naive = (0.999 * naive + 0.001 * model.lin.weight.detach()).to(torch.bfloat16)
    assert torch.equal(naive, torch.ones_like(naive))  # a bf16 average never moves
    want = 1 + 0.0078125 * (1 - 0.999**100)
    torch.testing.assert_close(anchor.average["lin.weight"], torch.full((2, 3), want), atol=1e-6, rtol=0)
    assert anchor.average["lin.weight"].dtype == torch.float32


def test_floating_buffers_are_averaged_integer_buffers_are_not():
    model = Tiny()
    anchor = EMAAnchor(model, eta=0.5)
    with torch.no_grad():
        model.running.fill_(4.0)
        model.count.fill_(9)
    anchor.step(model)
    assert torch.equal(anchor.module.running, torch.full((2,), 2.0))
    assert int(anchor.module.count) == 0


def test_state_dict_round_trip():
    model = Tiny()
    anchor = EMAAnchor(model, eta=0.7, every=2)
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    for _ in range(3):
        anchor.step(model)
    state = {k: v.clone() for k, v in anchor.state_dict().items()}
    fresh = EMAAnchor(Tiny(), eta=0.7, every=2)
    fresh.load_state_dict(state)
    assert fresh.num_steps == 3 and fresh.num_updates == 1
    torch.testing.assert_close(fresh.module.lin.weight, anchor.module.lin.weight)
    # the step counter carries over: the next due update happens at step 4 in both
    assert fresh.step(model) and anchor.step(model)
    with pytest.raises(KeyError, match="anchor state mismatch"):
        fresh.load_state_dict({"average.nope": torch.zeros(1), "num_steps": torch.tensor(0),
                               "num_updates": torch.tensor(0)})


def test_invalid_mode():
    with pytest.raises(ValueError, match="anchor mode must be"):
        EMAAnchor(Tiny(), eta=0.5, mode="half")


def test_lora_mode_averages_only_adapters_and_swaps_into_policy():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    policy = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                               init_lora_weights=False))
    anchor = EMAAnchor(policy, eta=0.5)
    assert anchor.mode == "lora" and anchor.module is None
    assert set(anchor.average) == {n for n, p in policy.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in anchor.average)
    x = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        base_before = {n: p.clone() for n, p in policy.named_parameters() if not p.requires_grad}
        out0 = policy(x).logits
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.5)
        out1 = policy(x).logits
    anchor.step(policy)
    with torch.no_grad():
        with anchor.use(policy) as m:
            out_anchor = m(x).logits
        out_after = policy(x).logits
    torch.testing.assert_close(out_after, out1)  # policy restored
    assert not torch.allclose(out_anchor, out0) and not torch.allclose(out_anchor, out1)
    for n, p in policy.named_parameters():
        if p.requires_grad:
            assert torch.allclose(anchor.average[n], p - 0.25)  # 0.5 * p0 + 0.5 * (p0 + 0.5)
        else:
            assert torch.equal(p, base_before[n])


@pytest.mark.parametrize("eta", [0.5, 0.9, 0.95])
def test_quadratic_toy_stability_boundary(eta):
    """docs/METHOD.md section 2: GD on -g.theta + beta/2 lambda (theta - theta_ema)^2 with the EMA every step is
    stable iff a beta lambda < 1 + 1/eta, and the lag settles at eta a g / (1 - eta + eta a beta lambda)."""
    a, beta, g = 0.1, 1.0, 0.3

    def run(lam, steps):
        model = nn.Module()
        model.theta = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        anchor = EMAAnchor(model, eta=eta)
        opt = torch.optim.SGD(model.parameters(), lr=a)
        for _ in range(steps):
            d = model.theta - anchor.module.theta
            loss = -g * model.theta.sum() + 0.5 * beta * lam * (d**2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            anchor.step(model)
        return (model.theta - anchor.module.theta).item()

    boundary = (1 + 1 / eta) / (a * beta)
    for lam in (0.97 * boundary, 0.5 * boundary):
        d = run(lam, 3000)
        torch.testing.assert_close(d, eta * a * g / (1 - eta + eta * a * beta * lam), atol=1e-9, rtol=1e-7)
    assert abs(run(1.03 * boundary, 1500)) > 1e6
