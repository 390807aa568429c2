"""Every claim of the estimator table of docs/METHOD.md section 3, by exact enumeration over the sampled token."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from emapg import kl
from emapg.models.lm import token_logprobs

V = 12


@pytest.fixture(autouse=True)
def float64_default():
    """Exactness claims are checked in float64; restore the default for the other test modules."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make(V=V, seed=0, off_policy=False):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    theta = (torch.randn(V, generator=g) * 1.5).requires_grad_(True)
    anchor = theta.detach() + torch.randn(V, generator=g) * 0.8
    samp = theta.detach() + torch.randn(V, generator=g) * 0.5 if off_policy else None
    return theta, anchor, samp


def expectation(estimator, theta, anchor, samp, k=0, form="unbiased", head=None):
    """E_{p ~ pi_samp}[estimate] and E[grad estimate] by enumerating every token p."""
    Vn = theta.shape[0]
    tokens = torch.arange(Vn)
    rows = lambda t: t.unsqueeze(0).expand(Vn, Vn)  # noqa: E731 - the same distribution at V positions
    est = kl.token_kl(rows(theta), rows(anchor), tokens, estimator=estimator, k=k,
                      sampling_logits=None if samp is None else rows(samp), form=form, head=head)
    weights = torch.softmax(theta if samp is None else samp, -1).detach()
    value = (weights * est).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def exact(theta, anchor, which):
    logp, loga = torch.log_softmax(theta, -1), torch.log_softmax(anchor, -1)
    value = (logp.exp() * (logp - loga)).sum() if which == "reverse" else (loga.exp() * (loga - logp)).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def head_mass_grad(theta, samp_or_anchor, k):
    """grad pi_theta(q) where q = top-k of the given logits."""
    q = samp_or_anchor.detach().topk(k).indices
    (grad,) = torch.autograd.grad(torch.softmax(theta, -1)[q].sum(), theta)
    return grad


CLOSE = dict(atol=1e-12, rtol=1e-10)
policies = pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])


@policies
@pytest.mark.parametrize("estimator", ["k1", "k3", "k3pp", "k4", "exact_reverse"])
def test_value_unbiased_for_reverse_kl(estimator, off_policy):
    theta, anchor, samp = make(off_policy=off_policy)
    value, _ = expectation(estimator, theta, anchor, samp)
    torch.testing.assert_close(value, exact(theta, anchor, "reverse")[0], **CLOSE)


@policies
@pytest.mark.parametrize("estimator", ["k5", "exact_forward"])
def test_value_unbiased_for_forward_kl(estimator, off_policy):
    theta, anchor, samp = make(off_policy=off_policy)
    value, _ = expectation(estimator, theta, anchor, samp)
    torch.testing.assert_close(value, exact(theta, anchor, "forward")[0], **CLOSE)


@policies
@pytest.mark.parametrize("estimator", ["k3pp", "k4", "exact_reverse"])
def test_gradient_unbiased_for_reverse_kl(estimator, off_policy):
    theta, anchor, samp = make(off_policy=off_policy)
    _, grad = expectation(estimator, theta, anchor, samp)
    torch.testing.assert_close(grad, exact(theta, anchor, "reverse")[1], **CLOSE)


@policies
@pytest.mark.parametrize("estimator", ["k5", "exact_forward"])
def test_gradient_unbiased_for_forward_kl(estimator, off_policy):
    theta, anchor, samp = make(off_policy=off_policy)
    _, grad = expectation(estimator, theta, anchor, samp)
    torch.testing.assert_close(grad, exact(theta, anchor, "forward")[1], **CLOSE)


@policies
def test_k1_expected_gradient_is_zero(off_policy):
    theta, anchor, samp = make(off_policy=off_policy)
    _, grad = expectation("k1", theta, anchor, samp)
    torch.testing.assert_close(grad, torch.zeros_like(grad), **CLOSE)
    assert exact(theta, anchor, "reverse")[1].abs().max() > 1e-2  # while the true gradient is not 0


def test_k2_value_biased_gradient_reverse_on_policy():
    theta, anchor, _ = make()
    value, grad = expectation("k2", theta, anchor, None)
    true_value, true_grad = exact(theta, anchor, "reverse")
    assert (value - true_value).abs() > 1e-3
    torch.testing.assert_close(grad, true_grad, **CLOSE)


@policies
def test_k3_gradient_is_forward_kl_gradient(off_policy):
    theta, anchor, samp = make(off_policy=off_policy)
    _, grad = expectation("k3", theta, anchor, samp)
    torch.testing.assert_close(grad, exact(theta, anchor, "forward")[1], **CLOSE)
    assert (grad - exact(theta, anchor, "reverse")[1]).abs().max() > 1e-2  # the wrong direction


@policies
def test_low_var_kl_is_k3_where_its_clamps_do_not_bind(off_policy):
    theta, anchor, samp = make(off_policy=off_policy)
    for a, b in zip(expectation("low_var_kl", theta, anchor, samp), expectation("k3", theta, anchor, samp),
                    strict=True):
        torch.testing.assert_close(a, b, **CLOSE)


def test_low_var_kl_clamps_as_verl_does():
    lp = torch.tensor([-1.0, -1.0, -30.0, 0.0], dtype=torch.float64, requires_grad=True)
    la = torch.tensor([-1.5, -15.0, -1.0, -40.0], dtype=torch.float64)
    value = kl.estimator_named("low_var_kl").sample(lp, la)
    log_w = (la - lp).detach().clamp(-20, 20)
    k3 = torch.exp(log_w) - 1 - log_w
    # in range: k3; log w = -14: k3 = 13 + e^-14 > 10, clamped; log w = 29 clamped to 20, then the value to 10
    torch.testing.assert_close(value.detach(), torch.stack([k3[0], torch.tensor(10.0, dtype=torch.float64),
                                                            torch.tensor(10.0, dtype=torch.float64),
                                                            torch.tensor(10.0, dtype=torch.float64)]))
    value.sum().backward()
    assert lp.grad[0] != 0 and (lp.grad[1:] == 0).all()  # a clamped value carries no gradient
    # the estimator declares where its clamp binds (the kl_clamp_frac diagnostic reads it), exactly the clamped ones
    assert kl.clamp_binds("low_var_kl", lp.detach(), la, None, None).tolist() == [False, True, True, True]
    assert kl.clamp_binds("k3", lp.detach(), la, None, None) is None


@policies
@pytest.mark.parametrize("k", [0, 1, 3, 6, V - 1, V])
def test_topk_reverse_unbiased_value_and_gradient_at_every_k(k, off_policy):
    theta, anchor, samp = make(off_policy=off_policy, seed=k)
    value, grad = expectation("topk_reverse", theta, anchor, samp, k=k)
    true_value, true_grad = exact(theta, anchor, "reverse")
    torch.testing.assert_close(value, true_value, **CLOSE)
    torch.testing.assert_close(grad, true_grad, **CLOSE)


@policies
@pytest.mark.parametrize("k", [0, 1, 3, 6, V - 1, V])
def test_topk_forward_unbiased_value_and_gradient_at_every_k(k, off_policy):
    theta, anchor, samp = make(off_policy=off_policy, seed=k)
    value, grad = expectation("topk_forward", theta, anchor, samp, k=k)
    true_value, true_grad = exact(theta, anchor, "forward")
    torch.testing.assert_close(value, true_value, **CLOSE)
    torch.testing.assert_close(grad, true_grad, **CLOSE)


@policies
@pytest.mark.parametrize("k", [1, 3, 6, V - 1])
def test_paper_form_reverse_gradient_bias_is_plus_grad_head_mass(k, off_policy):
    theta, anchor, samp = make(off_policy=off_policy, seed=k)
    value, grad = expectation("topk_reverse", theta, anchor, samp, k=k, form="paper")
    true_value, true_grad = exact(theta, anchor, "reverse")
    bias = head_mass_grad(theta, theta if samp is None else samp, k)
    torch.testing.assert_close(value, true_value, **CLOSE)  # value still unbiased
    torch.testing.assert_close(grad - true_grad, bias, **CLOSE)
    assert bias.abs().max() > 1e-3


@policies
@pytest.mark.parametrize("k", [1, 3, 6, V - 1])
def test_paper_form_forward_gradient_bias_is_minus_grad_head_mass(k, off_policy):
    theta, anchor, samp = make(off_policy=off_policy, seed=k)
    value, grad = expectation("topk_forward", theta, anchor, samp, k=k, form="paper")
    true_value, true_grad = exact(theta, anchor, "forward")
    bias = head_mass_grad(theta, anchor, k)
    torch.testing.assert_close(value, true_value, **CLOSE)
    torch.testing.assert_close(grad - true_grad, -bias, **CLOSE)
    assert bias.abs().max() > 1e-3


@pytest.mark.parametrize("estimator", ["topk_reverse", "topk_forward"])
def test_paper_bias_persists_when_policy_equals_anchor(estimator):
    theta, _, _ = make()
    _, grad = expectation(estimator, theta, theta.detach().clone(), None, k=4, form="paper")
    assert grad.abs().max() > 1e-3  # true gradient is 0 here
    _, grad = expectation(estimator, theta, theta.detach().clone(), None, k=4)
    torch.testing.assert_close(grad, torch.zeros_like(grad), **CLOSE)


@pytest.mark.parametrize("form", ["unbiased", "paper"])
def test_paper_and_unbiased_agree_at_k_zero_and_k_vocab_for_reverse(form):
    theta, anchor, samp = make(off_policy=True)
    for k in (0, V):
        _, grad = expectation("topk_reverse", theta, anchor, samp, k=k, form=form)
        torch.testing.assert_close(grad, exact(theta, anchor, "reverse")[1], **CLOSE)


def test_topk_k_zero_is_k4_plus_zero_mean_term_and_k_vocab_is_exact():
    theta, anchor, samp = make(off_policy=True)
    tokens = torch.arange(V)
    rows = lambda t: t.unsqueeze(0).expand(V, V)  # noqa: E731
    tk0 = kl.token_kl(rows(theta), rows(anchor), tokens, estimator="topk_reverse", k=0, sampling_logits=rows(samp))
    k4 = kl.token_kl(rows(theta), rows(anchor), tokens, estimator="k4", sampling_logits=rows(samp))
    torch.testing.assert_close(tk0, k4, **CLOSE)  # (r - 1) has value 0
    tkv = kl.token_kl(rows(theta), rows(anchor), tokens, estimator="topk_reverse", k=V, sampling_logits=rows(samp))
    ex = kl.token_kl(rows(theta), rows(anchor), tokens, estimator="exact_reverse")
    torch.testing.assert_close(tkv, ex, **CLOSE)  # per sample, not only in expectation


def test_clipped_importance_weight_is_biased_unclipped_is_not():
    theta, anchor, samp = make(off_policy=True, seed=3)
    s_max = (torch.softmax(theta, -1) / torch.softmax(samp, -1)).max().item()
    tokens = torch.arange(V)
    rows = lambda t: t.unsqueeze(0).expand(V, V)  # noqa: E731
    weights = torch.softmax(samp, -1)
    for clip, biased in ((None, False), (s_max * 0.5, True)):
        est = kl.token_kl(rows(theta), rows(anchor), tokens, estimator="k4", sampling_logits=rows(samp), is_clip=clip)
        err = ((weights * est).sum() - exact(theta, anchor, "reverse")[0]).abs().item()
        assert (err > 1e-6) == biased


@settings(max_examples=30, deadline=None)
@given(V=st.integers(2, 40), k_frac=st.floats(0, 1), seed=st.integers(0, 10_000), off=st.booleans(),
       estimator=st.sampled_from(["topk_reverse", "topk_forward"]))
def test_topk_unbiased_property(V, k_frac, seed, off, estimator):
    theta, anchor, samp = make(V=V, seed=seed, off_policy=off)
    k = round(k_frac * V)
    value, grad = expectation(estimator, theta, anchor, samp, k=k)
    true_value, true_grad = exact(theta, anchor, "forward" if estimator == "topk_forward" else "reverse")
    torch.testing.assert_close(value, true_value, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(grad, true_grad, atol=1e-10, rtol=1e-8)


# ---- the top-k family: every head and tail, by enumeration --------------------------------------------------
# docs/METHOD.md section 3.5: with a the first distribution of the KL and b the second (reverse: a = pi,
# b = anchor; forward: a = anchor, b = pi), T the head, a_T its mass and R = sum_{v not in T} a log(a(v|T^c) /
# b(v|T^c)) the tail's share of the KL (its mass times its conditional KL), the tails' expectations are
#   unbiased, residual: KL                      (value and gradient)
#   paper:              KL, gradient grad KL + grad pi(T) (reverse) / - grad pi(T) (forward)
#   bucket:             KL - R = sum_T a log(a/b) + a(T^c) log(a(T^c)/b(T^c))
#   truncated:          sum_T a log(a/b)
#   renormalised:       sum_T (a/a_T) log((a/a_T)/(b/b_T)) (0 for an empty head)
# each written below over the whole vocabulary, independently of emapg.kl, with T held fixed.


def head_set(choice, k, theta, anchor, samp):
    """The head T as a [V] 0/1 mask: the top-k ids of pi_samp, of the anchor, or both (argsort, not topk)."""
    def top(logits):
        m = torch.zeros(logits.shape[0])
        m[torch.argsort(logits.detach(), descending=True)[:k]] = 1.0
        return m
    sampler = top(theta if samp is None else samp)
    return {"sampler": sampler, "anchor": top(anchor), "union": torch.maximum(sampler, top(anchor))}[choice]


def expected_by_formula(direction, form, theta, anchor, T):
    """What the tail's expectation is by docs/METHOD.md section 3.5, as a function of theta (T fixed)."""
    lp, la = torch.log_softmax(theta, -1), torch.log_softmax(anchor, -1)
    la_, lb = (lp, la) if direction == "reverse" else (la, lp)
    a = la_.exp()
    full = (a * (la_ - lb)).sum()
    head = (T * a * (la_ - lb)).sum()
    a_in, b_in = (T * a).sum(), (T * lb.exp()).sum()
    if form in ("unbiased", "residual"):
        return full
    if form == "paper":
        pi_in = (T * lp.exp()).sum()
        sign = 1.0 if direction == "reverse" else -1.0
        return full + sign * (pi_in - pi_in.detach())  # the KL's value, its gradient plus or minus grad pi(T)
    if form == "bucket":
        out = 1 - T
        a_out, b_out = 1 - a_in, 1 - b_in
        r = (out * a * ((la_ - torch.log(a_out)) - (lb - torch.log(b_out)))).sum() if out.any() else 0.0
        return full - r
    if form == "truncated":
        return head
    if not T.any():
        return 0.0 * theta.sum()  # an empty head: 0, gradient 0
    return (T * (a / a_in) * ((la_ - torch.log(a_in)) - (lb - torch.log(b_in)))).sum()


FAMILY = [(e, h, f) for e in ("topk_reverse", "topk_forward") for h in kl.HEAD_CHOICES for f in kl.FORMS]


@policies
@pytest.mark.parametrize("k", [0, 1, 5, V - 1, V])
@pytest.mark.parametrize("estimator,head,form", FAMILY)
def test_every_head_and_tail_has_the_expectation_method_states(estimator, head, form, k, off_policy):
    """Value and gradient, in expectation over the sampled token, enumerated exactly, against section 3.5's
    formula; the unbiased tails against the KL itself; the biased ones provably biased where T is partial."""
    theta, anchor, samp = make(off_policy=off_policy, seed=k + 7)
    direction = kl.estimator_named(estimator).direction
    value, grad = expectation(estimator, theta, anchor, samp, k=k, form=form, head=head)
    T = head_set(head, k, theta, anchor, samp)
    want = expected_by_formula(direction, form, theta, anchor, T)
    (want_grad,) = torch.autograd.grad(want, theta)
    torch.testing.assert_close(value, want.detach(), **CLOSE)
    torch.testing.assert_close(grad, want_grad, **CLOSE)
    true_value, true_grad = exact(theta, anchor, direction)
    if kl.TAILS[form].unbiased:
        torch.testing.assert_close(value, true_value, **CLOSE)
        torch.testing.assert_close(grad, true_grad, **CLOSE)
    elif 0 < T.sum() < V - (form == "bucket"):  # a partial head: the bias is there, the test tells tails apart
        # (with one id outside, the bucket is exact: a single id's conditional KL is 0)
        assert (grad - true_grad).abs().max() > 1e-6
        assert form == "paper" or (value - true_value).abs() > 1e-6


def test_the_union_head_counts_a_shared_id_once():
    sampler = torch.tensor([[3, 1, 4]])
    ids, mask = kl.union_mask(sampler, torch.tensor([[4, 5, 3]]))
    assert ids.tolist() == [[3, 1, 4, 4, 5, 3]] and mask.tolist() == [[True, True, True, False, True, False]]


def test_a_sampled_estimator_refuses_a_tail_and_a_head():
    theta, anchor, _ = make()
    with pytest.raises(ValueError, match="is a top-k estimator's tail; k3 is defined in unbiased, paper"):
        kl.token_kl(theta[None], anchor[None], torch.tensor([0]), estimator="k3", form="bucket")
    with pytest.raises(ValueError, match="k3 is not a top-k estimator"):
        kl.token_kl(theta[None], anchor[None], torch.tensor([0]), estimator="k3", head="union")


# ---- lean form == reference form ---------------------------------------------------------------


def lean_from_logits(policy_logits, anchor_logits, tokens, estimator, k, sampling_logits, form, head=None):
    logp = torch.log_softmax(policy_logits, -1)
    loga = torch.log_softmax(anchor_logits, -1)
    samp = policy_logits if sampling_logits is None else sampling_logits
    est = kl.estimator_named(estimator)
    if est.topk:
        q, mask = kl.choose_head(head or est.default_head, k, samp, anchor_logits)
    else:
        q, mask = kl.head_ids(estimator, policy_logits.shape[-1], samp, anchor_logits), None
    gather = lambda t, i: t.gather(-1, i)  # noqa: E731
    tok = tokens.unsqueeze(-1)
    return kl.kl_from_logprobs(
        estimator, gather(logp, tok).squeeze(-1), gather(loga, tok).squeeze(-1),
        samp_logp_tok=None if sampling_logits is None else gather(torch.log_softmax(samp, -1), tok).squeeze(-1),
        policy_logp_q=gather(logp, q), anchor_logp_q=gather(loga, q), in_q=(q == tok).any(-1), head_mask=mask,
        form=form)


# Estimators with an exact head: every head and tail of the top-k ones, and the exact ones. A purely sampled
# estimator's two forms evaluate the same declared term on the same two numbers; the enumeration tests
# above prove those.
HEAD_CASES = [(e, h, f) for e, h, f in FAMILY] + [(name, None, "unbiased") for name, est in kl.ESTIMATORS.items()
                                                  if est.head == "all"]


@pytest.mark.parametrize("estimator,head,form", HEAD_CASES)
@pytest.mark.parametrize("off_policy", [False, True])
def test_lean_form_equals_reference_form(estimator, head, form, off_policy):
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    N, Vn, k = 20, 50, 7
    policy = torch.randn(N, Vn, generator=g).requires_grad_(True)
    anchor = policy.detach() + 0.5 * torch.randn(N, Vn, generator=g)
    samp = policy.detach() + 0.3 * torch.randn(N, Vn, generator=g) if off_policy else None
    tokens = torch.randint(0, Vn, (N,), generator=g)
    ref = kl.token_kl(policy, anchor, tokens, estimator=estimator, k=k, sampling_logits=samp, form=form, head=head)
    lean = lean_from_logits(policy, anchor, tokens, estimator, k, samp, form, head)
    torch.testing.assert_close(lean, ref, **CLOSE)
    (g_ref,) = torch.autograd.grad(ref.sum(), policy)
    (g_lean,) = torch.autograd.grad(lean.sum(), policy)
    torch.testing.assert_close(g_lean, g_ref, **CLOSE)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_lean_from_hidden_states_matches_reference(dtype, tol):
    """The trainer's path: chunked log-probs from hidden states -> lean KL, vs full logits -> token_kl."""
    g = torch.Generator(torch.get_default_device()).manual_seed(2)
    N, H, Vn, k, T = 37, 16, 300, 8, 0.7
    hidden = torch.randn(N, H, generator=g, dtype=torch.float32).to(dtype).requires_grad_(True)
    weight = (torch.randn(Vn, H, generator=g, dtype=torch.float32) * 0.3).to(dtype).requires_grad_(True)
    anchor_w = (weight.detach().float() + 0.05 * torch.randn(Vn, H, generator=g, dtype=torch.float32)).to(dtype)
    tokens = torch.randint(0, Vn, (N,), generator=g)
    with torch.no_grad():
        samp = token_logprobs(hidden.detach(), weight.detach(), tokens, temperature=T, k_self=k, chunk_size=8)
        anc = token_logprobs(hidden.detach(), anchor_w, tokens, ids=samp.topk_ids, temperature=T, chunk_size=8)
    pol = token_logprobs(hidden, weight, tokens, ids=samp.topk_ids, temperature=T, chunk_size=8, entropy=True)
    lean = kl.kl_from_logprobs("topk_reverse", pol.logp_tok, anc.logp_tok, samp_logp_tok=samp.logp_tok,
                               policy_logp_q=pol.logp_ids, anchor_logp_q=anc.logp_ids,
                               in_q=(samp.topk_ids == tokens[:, None]).any(-1))
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    logits = h64 @ w64.T / T
    ref = kl.token_kl(logits, hidden.detach().double() @ anchor_w.double().T / T, tokens, k=k,
                      sampling_logits=logits.detach())
    torch.testing.assert_close(lean.double(), ref.detach(), atol=tol, rtol=tol)
    gh, gw = torch.autograd.grad(lean.sum(), (hidden, weight))
    rh, rw = torch.autograd.grad(ref.sum(), (h64, w64))
    for got, want in ((gh, rh), (gw, rw)):  # bf16 rounds per element: compare in norm
        assert (got.double() - want).norm() / want.norm() < tol
    ent_ref = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(pol.entropy.double(), ent_ref.detach(), atol=tol, rtol=tol)


def test_bad_arguments_raise_clear_errors():
    x = torch.zeros(2, 5)
    t = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl.token_kl(x, x, t, estimator="k9")
    with pytest.raises(ValueError, match="unknown KL form"):
        kl.token_kl(x, x, t, form="Paper")


def test_a_tail_registered_from_a_users_module_is_taken_by_the_config_and_both_forms():
    """An open registry: a tail declared outside emapg (here: the head's terms doubled, no sampling) is a
    valid algo.form at once and both code forms compute it; a name that exists is refused."""
    from emapg.config import load_config

    tail = kl.Tail("doubled_head", lambda head, a_in, b_in: 2 * head)
    kl.register_tail(tail)
    try:
        cfg = load_config(None, ["algo.form=doubled_head", "algo.k=4"])
        assert cfg.algo.form == "doubled_head"
        theta, anchor, samp = make(off_policy=True)
        value, _ = expectation("topk_reverse", theta, anchor, samp, k=4, form="doubled_head")
        truncated, _ = expectation("topk_reverse", theta, anchor, samp, k=4, form="truncated")
        torch.testing.assert_close(value, 2 * truncated, **CLOSE)
        N, Vn = 6, 30
        policy = torch.randn(N, Vn, dtype=torch.float64, requires_grad=True)
        anc = torch.randn(N, Vn, dtype=torch.float64)
        tokens = torch.randint(0, Vn, (N,))
        torch.testing.assert_close(lean_from_logits(policy, anc, tokens, "topk_reverse", 4, None, "doubled_head"),
                                   kl.token_kl(policy, anc, tokens, k=4, form="doubled_head"), **CLOSE)
        with pytest.raises(ValueError, match="exists already"):
            kl.register_tail(tail)
    finally:
        del kl.TAILS["doubled_head"]
    with pytest.raises(Exception, match="algo.form: expected one of unbiased, paper, bucket"):
        load_config(None, ["algo.form=doubled_head"])
