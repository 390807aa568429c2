"""emapg.algo: the step's loss equals its reference composition from full logits, and micro-batch
losses (what the trainer accumulates) add up to the mini-batch's loss, in value and gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from emapg import algo, kl
from emapg.config import AlgoConfig, RolloutConfig
from emapg.models.lm import TokenLogprobs
from emapg.objective import AGGREGATIONS, aggregate, clipped_surrogate
from emapg.rollout.sampling import RolloutBatch, SamplingSpec

B, L, V, K = 6, 5, 11, 3


def make_case(seed: int, estimator: str):
    """Full logits [B, L, V] of the policy (a leaf), the anchor and the sampler, and the batch the
    sampler would have recorded (tokens, their log-probs, its top-K ids)."""
    g = torch.Generator().manual_seed(seed)
    samp = torch.randn(B, L, V, generator=g, dtype=torch.float64)
    policy = (samp + 0.3 * torch.randn(B, L, V, generator=g, dtype=torch.float64)).requires_grad_(True)
    anchor = samp + 0.5 * torch.randn(B, L, V, generator=g, dtype=torch.float64)
    tokens = torch.multinomial(samp.softmax(-1).reshape(-1, V), 1, generator=g).reshape(B, L)
    mask = (torch.rand(B, L, generator=g) > 0.25).long()
    mask[:, 0] = 1
    samp_logp = samp.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    ones = torch.ones(B, 1, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=ones, prompt_mask=ones, response_ids=tokens, response_mask=mask,
                         samp_logp=samp_logp * mask, n=1, samp_topk=samp.topk(K, -1).indices,
                         advantages=torch.randn(B, generator=g, dtype=torch.float64))
    return policy, anchor, samp, batch


def rows(batch: RolloutBatch, sl: slice) -> RolloutBatch:
    pick = lambda t: None if t is None else t[sl]  # noqa: E731
    return RolloutBatch(prompt_ids=batch.prompt_ids[sl], prompt_mask=batch.prompt_mask[sl],
                        response_ids=batch.response_ids[sl], response_mask=batch.response_mask[sl],
                        samp_logp=batch.samp_logp[sl], n=1, samp_topk=pick(batch.samp_topk),
                        advantages=batch.advantages[sl])


def passes(policy: torch.Tensor, anchor: torch.Tensor, mb: RolloutBatch, a: AlgoConfig):
    """What the trainer's passes give algo.loss: gathered statistics at the valid positions, with
    the head ids algo.anchor_request names."""
    valid = mb.response_mask.bool()
    tok = mb.response_ids[valid]
    logp, loga = policy[valid].log_softmax(-1), anchor[valid].log_softmax(-1)
    head = algo.kl_head(a)
    ids, k_self = algo.anchor_request(head, mb, V)
    topk = loga.topk(k_self, -1) if k_self else None
    st = TokenLogprobs(logp_tok=loga.gather(-1, tok[:, None])[:, 0], lse=torch.zeros(len(tok)),
                       logp_ids=None if ids is None else loga.gather(-1, ids),
                       topk_ids=None if topk is None else topk.indices,
                       topk_logp=None if topk is None else topk.values)
    anc = algo.anchor_stats(head, st, ids, mb, None, None)
    pol = TokenLogprobs(logp_tok=logp.gather(-1, tok[:, None])[:, 0], lse=torch.zeros(len(tok)),
                        logp_ids=None if anc.head_ids is None else logp.gather(-1, anc.head_ids))
    return pol, anc


# every estimator in each of its forms; the top-k ones with every head and tail
CASES = [(name, form, head) for name, est in kl.ESTIMATORS.items() for form in est.forms()
         for head in (kl.HEAD_CHOICES if est.topk else (None,)) if est.topk or form == "unbiased" or est.paper]


@pytest.mark.parametrize("estimator,form,head", CASES)
@pytest.mark.parametrize("agg", list(AGGREGATIONS))
def test_loss_equals_its_reference_composition_from_full_logits(estimator, form, head, agg):
    """loss = agg(clipped surrogate) + beta * agg(token_kl), the KL from kl.token_kl on full logits
    (pi_samp the sampler, s its importance weight), pi_old = pi_samp."""
    policy, anchor, samp, batch = make_case(0, estimator)
    a = AlgoConfig(kl=estimator, k=K, form=form, head=head, beta=0.3, agg=agg)
    counts = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(B), "max_len": L}
    pol, anc = passes(policy, anchor, batch, a)
    got, stats = algo.loss(pol, anc, batch, a, counts)
    mask = batch.response_mask
    logp_tok = policy.log_softmax(-1).gather(-1, batch.response_ids[..., None])[..., 0]
    pg = clipped_surrogate(logp_tok, batch.samp_logp, batch.advantages, a.eps_low, a.eps_high, a.dual_clip).loss
    kl_tok = kl.token_kl(policy, anchor, batch.response_ids, estimator=estimator, k=K, sampling_logits=samp,
                         form=form, head=head)
    want = aggregate(pg, mask, agg, **counts) + 0.3 * aggregate(kl_tok, mask, agg, **counts)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    (g_got,) = torch.autograd.grad(got, policy)
    (g_want,) = torch.autograd.grad(want, policy)
    torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-12)
    assert stats["tokens"] == float(mask.sum())
    assert stats["kl"] == pytest.approx(float(aggregate(kl_tok, mask, agg, **counts)), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(micro=st.integers(1, 4), seed=st.integers(0, 1000), agg=st.sampled_from(list(AGGREGATIONS)),
       case=st.sampled_from(CASES))
def test_micro_batch_losses_add_up_to_the_mini_batch_loss(micro, seed, agg, case):
    estimator, form, head = case
    policy, anchor, _, batch = make_case(seed, estimator)
    a = AlgoConfig(kl=estimator, k=K, form=form, head=head, beta=0.05, agg=agg)
    counts = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(B), "max_len": L}

    def loss_of(sl: slice):
        mb = rows(batch, sl)
        return algo.loss(*passes(policy[sl], anchor[sl], mb, a), mb, a, counts)[0]

    whole = loss_of(slice(0, B))
    (g_whole,) = torch.autograd.grad(whole, policy)
    total = sum(loss_of(slice(i, i + micro)) for i in range(0, B, micro))
    (g_acc,) = torch.autograd.grad(total, policy)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(g_acc, g_whole)


def test_what_the_passes_gather_follows_the_estimators_declaration():
    _, _, _, batch = make_case(0, "k3")
    n = int(batch.response_mask.sum())
    def request(name, k):
        return algo.anchor_request(algo.kl_head(AlgoConfig(kl=name, k=k)), batch, V)

    ids, k_self = request("topk_reverse", K)
    assert torch.equal(ids, batch.samp_topk[batch.response_mask.bool()]) and k_self == 0
    assert request("topk_forward", K) == (None, K)
    ids, k_self = request("exact_forward", K)
    assert ids.shape == (n, V) and torch.equal(ids[3], torch.arange(V)) and k_self == 0
    assert request("k3", K) == (None, 0)
    assert request("topk_reverse", 0) == (None, 0) and request("topk_forward", 0) == (None, 0)
    # the sampler records the head's ids only when the head is the sampler's
    names = ("topk_reverse", "topk_forward", "exact_reverse", "k3")
    heads = [algo.kl_head(AlgoConfig(kl=name, k=32)) for name in names]
    assert [h.sampler_k for h in heads] == [32, 0, 0, 0]
    # a head named in the config: the union gathers the sampler's ids and finds the anchor's own
    union = algo.kl_head(AlgoConfig(kl="topk_forward", k=K, head="union"))
    assert union.sampler_k == K and algo.anchor_request(union, batch, V)[1] == K
    assert algo.kl_head(AlgoConfig(kl="topk_reverse", k=K, head="anchor")).sampler_k == 0
    assert [h.kind for h in heads] == ["sampler", "anchor", "all", "none"]
    spec = algo.rollout_sampling(RolloutConfig(n=3, temperature=0.7, top_p=0.9, max_new_tokens=9), heads[0])
    assert spec == SamplingSpec(n=3, temperature=0.7, top_p=0.9, max_new_tokens=9, greedy=False, k=32)
    assert algo.rollout_sampling(RolloutConfig(), heads[1]).k == 0
    assert not algo.needs_old_pass(AlgoConfig(), 1.0)
    assert algo.needs_old_pass(AlgoConfig(), 0.9) and algo.needs_old_pass(AlgoConfig(ppo_epochs=2), 1.0)


def test_the_head_and_clamp_telemetry_counts_what_it_names():
    """head_mass / head_mass_anchor: the head's mass under each (sums over tokens), tail_token_frac: sampled
    tokens outside the head, kl_clamp_frac: tokens whose importance weight is_clip cut."""
    policy, anchor, samp, batch = make_case(3, "topk_reverse")
    a = AlgoConfig(kl="topk_reverse", k=K, head="union", beta=0.3, is_clip=1.05)
    counts = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(B), "max_len": L}
    _, stats = algo.loss(*passes(policy, anchor, batch, a), batch, a, counts)
    valid = batch.response_mask.bool()
    lp, la, sp = (t[valid].detach().log_softmax(-1) for t in (policy, anchor, samp))
    tok = batch.response_ids[valid]
    head = torch.zeros_like(lp, dtype=torch.bool)
    head.scatter_(-1, sp.topk(K, -1).indices, True)
    head.scatter_(-1, la.topk(K, -1).indices, True)
    assert stats["head_mass"] == pytest.approx(float((lp.exp() * head).sum()), rel=1e-9)
    assert stats["head_mass_anchor"] == pytest.approx(float((la.exp() * head).sum()), rel=1e-9)
    assert stats["tail_token_frac"] == float((~head.gather(-1, tok[:, None])[:, 0]).sum())
    s = torch.exp(lp.gather(-1, tok[:, None])[:, 0] - sp.gather(-1, tok[:, None])[:, 0])
    assert stats["kl_clamp_frac"] == float((s > 1.05).sum()) > 0
