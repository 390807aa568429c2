"""One EMA-PG step's math (docs/METHOD.md sections 2-4), in the paper's symbols.

pi_theta is the policy being trained, pi_samp the distribution the sampler drew from (pi_old at the
sampling temperature, after top-p), pi_old the policy before this step's updates (the PPO ratio's
denominator), pi_ema the anchor (an EMA of pi_theta; frozen at the initial policy when eta = 1), and
q the head ids of a top-k KL estimator. Per micro-batch:

    rho  = pi_theta(p) / pi_old(p)                                  the PPO ratio of each token
    PG   = agg(clipped surrogate(rho, A))                           A: group advantages
    KL   = agg(KL-hat(pi_theta || pi_ema))                          estimator from emapg.kl
    loss = pg_coef * PG + beta * KL                                 pg_coef = 1 unless distilling

On-policy distillation (``algo.teacher``) puts a fixed teacher pi_T where pi_ema stands in KL; the
samples stay the policy's own, so the top-k reverse estimator is the unbiased per-token reverse KL to
the teacher, in value and gradient, at any k; ``pg_coef = 0`` drops the reward from the loss.

The trainer runs the passes; this module says what they must gather and composes the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from emapg import kl
from emapg.config import AlgoConfig, RolloutConfig
from emapg.models.lm import TokenLogprobs
from emapg.objective import aggregate, clipped_surrogate
from emapg.rollout.sampling import RolloutBatch, SamplingSpec


@dataclass(frozen=True)
class KLHead:
    """The ids q whose KL terms the estimator sums exactly, read from its declaration once per run.

    kind: ``sampler`` (pi_samp's top-k, recorded at sampling), ``anchor`` (the anchor's own top-k, found in
    the anchor pass), ``union`` (both: up to 2k ids), ``all`` (every id: the exact estimators) or ``none`` (a
    purely sampled estimator, or a top-k one at k = 0): :data:`emapg.kl.HEADS` and
    :data:`emapg.kl.HEAD_CHOICES`, one spelling. k: the head's size per set (0 unless top-k)."""

    kind: str
    k: int = 0

    @property
    def sampler_k(self) -> int:
        """How many top-k ids per token the sampler must record."""
        return self.k if self.kind in ("sampler", "union") else 0


def kl_head(a: AlgoConfig) -> KLHead:
    """The head of the configured estimator (``algo.kl`` at ``algo.k``, ``algo.head`` or its own)."""
    est = kl.estimator_named(a.kl)
    if est.topk:
        return KLHead(a.head or est.default_head, a.k) if a.k > 0 else KLHead("none")
    return KLHead(est.head)


def rollout_sampling(r: RolloutConfig, head: KLHead, old_pass: bool = False) -> SamplingSpec:
    """How training rollouts sample: the rollout config, recording the head's ids when it is the sampler's and
    no pi_old pass gives them (``old_pass``: its top-k is the head then, :func:`anchor_request`; the sampler
    records none, which spares vLLM k + 1 log-prob objects per token)."""
    return SamplingSpec(n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                        k=0 if old_pass else head.sampler_k)


@dataclass
class AnchorStats:
    """What the no-grad passes give one micro-batch, at its N valid positions: [N] / [N, k]."""

    logp_tok: Tensor  # log pi_ema(p)
    logp_head: Tensor | None  # log pi_ema(q), [N, k]
    head_ids: Tensor | None  # q, [N, k]: the ids the policy pass gathers too (None = no head)
    old_logp: Tensor  # log pi_old(p)
    init_logp_tok: Tensor | None = None  # log pi_init(p), for the kl_to_init diagnostic
    exact: bool = False  # the head is every id: no sampled tail term
    weight_logp: Tensor | None = None  # the KL's importance-weight denominator: None = log pi_samp(p)
    tis: Tensor | None = None  # [N] truncated importance weights min(pi_old / pi_samp, cap), or None
    head_mask: Tensor | None = None  # [N, k] which of head_ids are in the head (a union's repeats are not)


def anchor_request(head: KLHead, mb: RolloutBatch, vocab: int,
                   old_topk: Tensor | None = None) -> tuple[Tensor | None, int]:
    """What the anchor pass gathers: ``(ids, k_self)``. q is the sampler's top-k for a head that is the
    sampler's: pi_old's own top-k from the trainer's pi_old pass when one ran (``old_topk``, [N, k]: what the
    reference fork takes; under top-p the sampler's processed distribution has fewer than k ids at most
    positions and the rest of its top-k are -inf ties in no order), else as recorded at sampling; the anchor's
    own top-k (``k_self``, found in the pass) for one that is the anchor's, both for a union, every id for the
    exact estimators, nothing otherwise."""
    valid = mb.response_mask.bool()
    if head.kind == "all":
        return torch.arange(vocab, device=valid.device).expand(int(valid.sum()), vocab), 0
    if head.kind in ("sampler", "union"):
        ids = mb.samp_topk[valid] if old_topk is None else old_topk
        return ids, head.k if head.kind == "union" else 0
    if head.kind == "anchor":
        return None, head.k
    return None, 0


def needs_old_pass(a: AlgoConfig, top_p: float, recompute: bool = False) -> bool:
    """Whether pi_old needs its own no-grad pass. With one PPO epoch and top_p = 1 the sampler's
    log-probs are pi_old's; under top-p they are the truncated distribution's, not the policy's; and
    ``recompute`` (another engine sampled) takes pi_old from the trainer whatever the sampler says, where
    something uses it (the policy gradient, or the KL's weight; not pure distillation)."""
    return a.ppo_epochs > 1 or top_p < 1.0 or (recompute and (a.pg_coef > 0 or a.kl_weight == "old"))


def anchor_stats(head: KLHead, st: TokenLogprobs, ids: Tensor | None, mb: RolloutBatch, old_logp: Tensor | None,
                 init_logp_tok: Tensor | None, a: AlgoConfig | None = None,
                 recompute: bool = False) -> AnchorStats:
    """The anchor pass's output as :class:`AnchorStats`; ``old_logp=None``: pi_old = pi_samp. With
    ``recompute``, ``a.kl_weight == "old"`` makes the trainer's pi_old weigh the KL's sampled term (the
    search fork's choice), and ``a.tis_cap`` gives each token its truncated importance weight
    min(pi_old / pi_samp, cap)."""
    head_ids, logp_head, head_mask = ids, st.logp_ids, None
    if head.kind == "union":  # the sampler's ids, then the anchor's own that are not among them
        head_ids, head_mask = kl.union_mask(ids, st.topk_ids)
        logp_head = torch.cat([st.logp_ids, st.topk_logp], -1)
    elif st.topk_ids is not None:  # the anchor chose the head (its own top-k)
        head_ids, logp_head = st.topk_ids, st.topk_logp
    samp = mb.samp_logp[mb.response_mask.bool()]
    old = samp if old_logp is None else old_logp
    tis = None
    if recompute and a is not None and a.tis_cap is not None:
        tis = torch.exp(old - samp).clamp(max=a.tis_cap).detach()
    return AnchorStats(st.logp_tok, logp_head, head_ids, old, init_logp_tok, exact=head.kind == "all",
                       weight_logp=old if recompute and a is not None and a.kl_weight == "old" else None, tis=tis,
                       head_mask=head_mask)


def _scatter(values: Tensor, mask: Tensor) -> Tensor:
    """[N] values of the valid positions back into a zero [B, L] tensor (differentiable)."""
    return values.new_zeros(mask.shape).index_put(mask.nonzero(as_tuple=True), values)


def loss(pol: TokenLogprobs, anc: AnchorStats, mb: RolloutBatch, a: AlgoConfig,
         counts: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
    """The loss of one micro-batch and its statistics (sums over its tokens; ``ratio_max`` a max).

    pol: the policy pass at the valid positions, with log pi_theta at ``anc.head_ids``.
    counts: the whole mini-batch's ``num_tokens``, ``num_seqs`` and ``max_len``, so that micro-batch
    losses add up to the mini-batch's loss exactly.
    """
    mask = mb.response_mask
    valid = mask.bool()
    p = mb.response_ids[valid]  # the sampled tokens
    # log pi_samp(p): the KL's importance weight s = pi_theta / pi_samp (algo.kl_weight: or pi_old's, or none)
    samp = mb.samp_logp[valid] if anc.weight_logp is None else anc.weight_logp
    has_tail = anc.head_ids is not None and not anc.exact
    in_q = kl.in_head(anc.head_ids, p) if has_tail else None
    kl_tok = kl.kl_from_logprobs(a.kl, pol.logp_tok, anc.logp_tok,
                                 samp_logp_tok=None if a.kl_weight == "none" else samp,
                                 policy_logp_q=pol.logp_ids, anchor_logp_q=anc.logp_head, in_q=in_q,
                                 head_mask=anc.head_mask, form=a.form, is_clip=a.is_clip)
    sur = clipped_surrogate(_scatter(pol.logp_tok, valid), _scatter(anc.old_logp, valid), mb.advantages,
                            a.eps_low, a.eps_high, a.dual_clip)
    pg_tok = sur.loss if anc.tis is None else sur.loss * _scatter(anc.tis, valid)  # TIS: off-sampler tokens
    pg = aggregate(pg_tok, mask, a.agg, **counts)
    kl_term = aggregate(_scatter(kl_tok, valid), mask, a.agg, **counts)
    total = a.pg_coef * pg + a.beta * kl_term
    stats = {"pg_loss": pg.item(), "kl": kl_term.item(),
             "clip_frac": float((sur.clipped * mask).sum()), "dual_clip_frac": float((sur.dual_clipped * mask).sum()),
             "ratio_max": float(sur.ratio[valid].max()) if valid.any() else 1.0, "tokens": float(valid.sum())}
    if anc.tis is not None:  # how far the sampler is from the trainer: sums over tokens
        stats["tis_weight"] = float(anc.tis.sum())
        stats["tis_capped_frac"] = float((anc.tis >= a.tis_cap).sum())
    clamped = kl.clamp_binds(a.kl, pol.logp_tok.detach(), anc.logp_tok, None if a.kl_weight == "none" else samp,
                             a.is_clip)
    if clamped is not None:  # tokens where a clamp of the KL's binds (is_clip on s, low_var_kl's bounds)
        stats["kl_clamp_frac"] = float(clamped.sum())
    if has_tail:  # the head's telemetry, sums over tokens: its mass under each, the sampled token outside it
        pi_in, an_in = kl.head_masses(pol.logp_ids.detach(), anc.logp_head, anc.head_mask)
        stats.update(head_mass=float(pi_in.sum()), head_mass_anchor=float(an_in.sum()),
                     tail_token_frac=float((~in_q).sum()), kl_tok_sq=float((kl_tok.detach() ** 2).sum()),
                     kl_tok_sum=float(kl_tok.detach().sum()))
    if anc.init_logp_tok is not None:  # diagnostic: k3 (unbiased, >= 0) of KL(pi_theta || pi_init)
        stats["kl_to_init"] = float(kl.kl_from_logprobs("k3", pol.logp_tok.detach(), anc.init_logp_tok,
                                                        samp_logp_tok=samp).sum())
    return total, stats
