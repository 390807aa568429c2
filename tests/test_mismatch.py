"""The sampler/trainer mismatch: a sampler whose log-probs are not the trainer's (vLLM in bf16, other kernels).
Simulated on the CPU by perturbing the sampler's recorded log-probs: pi_old recomputed by the trainer must be
the trainer's own, weigh the KL's sampled term, and give truncated importance weights that the loss applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from emapg import algo, kl
from emapg.config import ConfigError, load_config, recomputes_old
from emapg.objective import aggregate, clipped_surrogate
from emapg.run.trainer import Trainer

SMOKE = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"


def cfg(*overrides):
    return load_config(SMOKE, ["export=false", "save_every=0", "eval.size=0", *overrides])


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    """A trainer that recomputes pi_old with TIS at cap 1.5 and weighs the KL by pi_old, and one micro-batch
    whose sampler log-probs are off by up to +-0.5 nats (a sampler that rounds or computes differently), with
    advantages that are not 0 (a random model earns no reward)."""
    tr = Trainer(cfg("algo.recompute_old=true", "algo.tis_cap=1.5", "algo.kl_weight=old"),
                 tmp_path_factory.mktemp("run"), progress=False)
    batch = tr.rollout(1)
    mb = batch.micro_batches(tr.run.cfg.micro_batch_prompts)[0]
    gen = torch.Generator().manual_seed(0)
    mb.samp_logp = (mb.samp_logp + (torch.rand(mb.samp_logp.shape, generator=gen) - 0.5)) * mb.response_mask
    mb.advantages = torch.randn(mb.advantages.shape, generator=gen)
    return tr, mb


def moved_anchor(tr, mb):
    """The anchor pass with the anchor's log-probs moved (at step 1 it equals the policy: every KL would be 0)."""
    anc = tr.anchor_pass(mb)
    gen = torch.Generator().manual_seed(1)
    anc.logp_tok = anc.logp_tok - torch.rand(anc.logp_tok.shape, generator=gen)
    anc.logp_head = anc.logp_head - torch.rand(anc.logp_head.shape, generator=gen)
    return anc


def test_pi_old_is_the_trainers_own_and_weighs_the_kl(mismatched):
    tr, mb = mismatched
    anc = tr.anchor_pass(mb)
    valid = mb.response_mask.bool()
    mine = tr._logprobs(tr.run.model, mb).logp_tok
    torch.testing.assert_close(anc.old_logp, mine, rtol=0, atol=0)
    assert (anc.old_logp - mb.samp_logp[valid]).abs().max() > 0.1  # not the sampler's
    assert anc.weight_logp is anc.old_logp
    torch.testing.assert_close(anc.tis, torch.exp(anc.old_logp - mb.samp_logp[valid]).clamp(max=1.5))
    assert (anc.tis == 1.5).any() and (anc.tis < 1).any()


def reference_loss(tr, mb, anc, pol, weight_logp, tis):
    a, valid = tr.run.cfg.algo, mb.response_mask.bool()
    counts = {"num_tokens": float(valid.sum()), "num_seqs": float(mb.response_mask.shape[0]), "max_len": 8}
    scatter = lambda v: v.new_zeros(valid.shape).index_put(valid.nonzero(as_tuple=True), v)  # noqa: E731
    sur = clipped_surrogate(scatter(pol.logp_tok), scatter(anc.old_logp), mb.advantages, a.eps_low, a.eps_high,
                            a.dual_clip)
    pg = aggregate(sur.loss * (1 if tis is None else scatter(tis)), mb.response_mask, a.agg, **counts)
    kl_tok = kl.kl_from_logprobs(a.kl, pol.logp_tok, anc.logp_tok, samp_logp_tok=weight_logp,
                                 policy_logp_q=pol.logp_ids, anchor_logp_q=anc.logp_head,
                                 in_q=kl.in_head(anc.head_ids, mb.response_ids[valid]), form=a.form, is_clip=a.is_clip)
    return a.pg_coef * pg + a.beta * aggregate(scatter(kl_tok), mb.response_mask, a.agg, **counts), counts


def test_the_loss_applies_the_truncated_weights_and_the_kl_weight_it_is_told(mismatched):
    import dataclasses

    tr, mb = mismatched
    anc = moved_anchor(tr, mb)
    pol = tr._logprobs(tr.run.model, mb, ids=anc.head_ids)
    samp = mb.samp_logp[mb.response_mask.bool()]
    want, counts = reference_loss(tr, mb, anc, pol, anc.old_logp, anc.tis)
    total, stats = algo.loss(pol, anc, mb, tr.run.cfg.algo, counts)
    torch.testing.assert_close(total, want)
    assert stats["tis_capped_frac"] > 0 and 0 < stats["tis_weight"] / stats["tokens"] < 1.5
    # each part matters: without the truncated weights, or with the KL weighed over the sampler's log-probs, the
    # loss differs (s over pi_old is 1 here, before any update, so kl_weight none gives this loss too)
    for other in (reference_loss(tr, mb, anc, pol, anc.old_logp, None)[0],
                  reference_loss(tr, mb, anc, pol, samp, anc.tis)[0]):
        assert (other - want).abs() > 1e-5
    for weight, denominator in (("sampler", samp), ("none", None)):
        a = dataclasses.replace(tr.run.cfg.algo, kl_weight=weight)
        plain = dataclasses.replace(anc, weight_logp=None)
        torch.testing.assert_close(algo.loss(pol, plain, mb, a, counts)[0],
                                   reference_loss(tr, mb, anc, pol, denominator, anc.tis)[0])


def test_the_default_recomputes_for_another_engine_only():
    assert not recomputes_old(cfg()) and recomputes_old(cfg("rollout.backend=vllm"))
    assert not recomputes_old(cfg("rollout.backend=vllm", "algo.recompute_old=false"))
    assert not algo.needs_old_pass(cfg().algo, 1.0, recompute=False) and algo.needs_old_pass(cfg().algo, 1.0, True)
    with pytest.raises(ConfigError, match="algo.tis_cap: needs pi_old recomputed by the trainer"):
        cfg("algo.tis_cap=2")
    with pytest.raises(ConfigError, match="algo.kl_weight: old needs pi_old recomputed"):
        cfg("algo.kl_weight=old")
    # pure distillation on vLLM: nothing uses a recomputed pi_old, so no pass runs for it
    assert not algo.needs_old_pass(cfg("algo.pg_coef=0", "algo.teacher=tiny-llama", "algo.beta=1").algo, 1.0, True)


def test_a_run_with_recompute_and_tis_trains_and_logs_the_weights(tmp_path):
    Trainer(cfg("steps=2", "algo.recompute_old=true", "algo.tis_cap=2.0"), tmp_path, progress=False).train()
    from emapg.run.metrics import read_metrics

    rows = [r for r in read_metrics(tmp_path) if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]  # every step wrote its row (all() of no rows would pass)
    # one sampler and trainer (the same fp32 model): the weights are 1, up to the rounding of two passes
    assert all(abs(r["tis_weight"] - 1.0) < 1e-4 and r["tis_capped_frac"] == 0.0 for r in rows)
