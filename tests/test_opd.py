"""On-policy distillation (algo.teacher): the top-k reverse KL to a fixed teacher is the full-vocabulary
reverse KL in expectation, in value and gradient, at any k (exact enumeration through algo.loss); the
trainer's KL is to the teacher and its pass equals a plain forward of it; a wrong tokenizer is refused."""

from __future__ import annotations

import json

import pytest
import torch
from test_trainer import SMOKE, full_logits, strip_timing  # noqa: E402

from emapg import algo
from emapg.config import AlgoConfig, ConfigError, load_config
from emapg.kl import token_kl
from emapg.models.lm import TokenLogprobs
from emapg.models.zoo import byte_tokenizer, load_model, save_hf_folder, tiny_model, weights_digest
from emapg.rollout.sampling import RolloutBatch
from emapg.run.checkpoint import latest_checkpoint, load_checkpoint
from emapg.run.metrics import read_metrics
from emapg.run.trainer import Trainer

V = 7


def expected_loss_and_grad(z: torch.Tensor, t: torch.Tensor, a: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """E over the sampled token p ~ pi_theta (on-policy: the sampler is the policy, no grad through
    the draw) of algo.loss at one position, and of its gradient in the policy's logits z, by
    enumerating all V tokens. The head is the sampler's top-k, as recorded at sampling."""
    logt, logp0 = t.log_softmax(-1), z.detach().log_softmax(-1)
    k = algo.kl_head(a).sampler_k
    q = logp0.topk(k).indices[None] if k else None
    value, grad = torch.zeros((), dtype=z.dtype), torch.zeros_like(z)
    for p in range(V):
        logp = z.log_softmax(-1)  # a fresh graph per draw
        tok = torch.tensor([[p]])
        mask = torch.ones(1, 1, dtype=torch.long)
        samp = logp0[p].view(1, 1)
        mb = RolloutBatch(prompt_ids=mask, prompt_mask=mask, response_ids=tok, response_mask=mask, samp_logp=samp,
                          n=1, samp_topk=None if q is None else q[None], advantages=torch.zeros(1, dtype=z.dtype))
        ids, _ = algo.anchor_request(algo.kl_head(a), mb, V)
        st = TokenLogprobs(logp_tok=logt[p].view(1), lse=torch.zeros(1), logp_ids=None if ids is None else logt[ids])
        anc = algo.anchor_stats(algo.kl_head(a), st, ids, mb, None, None)
        pol = TokenLogprobs(logp_tok=logp[p].view(1), lse=torch.zeros(1),
                            logp_ids=None if anc.head_ids is None else logp[anc.head_ids])
        loss, _ = algo.loss(pol, anc, mb, a, {"num_tokens": 1.0, "num_seqs": 1.0, "max_len": 1})
        (g,) = torch.autograd.grad(loss, z)
        w = float(logp0[p].exp())
        value, grad = value + w * loss.detach(), grad + w * g
    return value, grad


def reverse_and_forward(z: torch.Tensor, t: torch.Tensor):
    """KL(pi_theta || pi_T) over all of V, and the gradients in z of it and of KL(pi_T || pi_theta)."""
    logp, logt = z.log_softmax(-1), t.log_softmax(-1)
    reverse = (logp.exp() * (logp - logt)).sum()
    forward = (logt.exp() * (logt - logp)).sum()
    return reverse.detach(), torch.autograd.grad(reverse, z, retain_graph=True)[0], torch.autograd.grad(forward, z)[0]


@pytest.mark.parametrize(("estimator", "k"), [("topk_reverse", 0), ("topk_reverse", 1), ("topk_reverse", 3),
                                              ("topk_reverse", V), ("k3pp", 0), ("k4", 0)])
def test_distillation_loss_and_gradient_are_the_full_reverse_kl_in_expectation(estimator, k):
    g = torch.Generator().manual_seed(k)
    z = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(True)
    t = 2.0 * torch.randn(V, generator=g, dtype=torch.float64)
    full, want_grad, _ = reverse_and_forward(z, t)
    value, grad = expected_loss_and_grad(z, t, AlgoConfig(kl=estimator, k=k, beta=0.5, pg_coef=0.0, teacher="t"))
    torch.testing.assert_close(value, 0.5 * full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, 0.5 * want_grad, rtol=1e-9, atol=1e-12)
    assert float(full) > 0.1  # teacher and student do differ


def test_k3_distils_with_the_forward_kls_gradient():
    """GRPO's k3 (the usual KL-only distillation loss): the reverse KL's value, but the forward KL's
    gradient in expectation (its importance weight carries no gradient), not the reverse KL's."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(True)
    t = 2.0 * torch.randn(V, generator=g, dtype=torch.float64)
    full, reverse_grad, forward_grad = reverse_and_forward(z, t)
    value, grad = expected_loss_and_grad(z, t, AlgoConfig(kl="k3", beta=1.0, pg_coef=0.0, teacher="t"))
    torch.testing.assert_close(value, full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, forward_grad, rtol=1e-9, atol=1e-12)
    assert float((grad - reverse_grad).abs().max()) > 1e-2


def test_the_paper_form_is_biased_in_gradient_where_ours_is_not():
    """The same enumeration fails for the paper's top-k form at 0 < k < V (spec section 3): the test can fail."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(True)
    t = 2.0 * torch.randn(V, generator=g, dtype=torch.float64)
    full = (z.softmax(-1) * (z.log_softmax(-1) - t.log_softmax(-1))).sum()
    (want,) = torch.autograd.grad(full, z)
    _, paper = expected_loss_and_grad(z, t, AlgoConfig(kl="topk_reverse", k=3, form="paper", beta=1.0, pg_coef=0.0))
    _, ours = expected_loss_and_grad(z, t, AlgoConfig(kl="topk_reverse", k=3, beta=1.0, pg_coef=0.0))
    assert float((paper - want).abs().max()) > 1e-3
    assert float((ours - want).abs().max()) < 1e-10


def test_the_loss_is_pg_coef_times_pg_plus_beta_times_kl():
    """With rewards in play (non-zero advantages): loss(pg_coef, beta) = pg_coef * PG + beta * KL, in value
    and gradient, each term from the same algo.loss with the other weighted 0."""
    import test_algo

    policy, teacher, _, batch = test_algo.make_case(4, "topk_reverse")
    counts = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(test_algo.B),
              "max_len": test_algo.L}

    def loss(pg_coef, beta):
        a = AlgoConfig(kl="topk_reverse", k=test_algo.K, beta=beta, pg_coef=pg_coef, teacher="t")
        return algo.loss(*test_algo.passes(policy, teacher, batch, a), batch, a, counts)[0]

    pg, kl_term, both = loss(1.0, 0.0), loss(0.0, 1.0), loss(0.7, 0.3)
    torch.testing.assert_close(both, 0.7 * pg + 0.3 * kl_term, rtol=1e-12, atol=1e-14)
    (g_both,) = torch.autograd.grad(both, policy)
    (g_pg,) = torch.autograd.grad(pg, policy)
    (g_kl,) = torch.autograd.grad(kl_term, policy)
    torch.testing.assert_close(g_both, 0.7 * g_pg + 0.3 * g_kl, rtol=1e-10, atol=1e-14)
    assert float(g_pg.abs().sum()) > 1e-3 and float(g_kl.abs().sum()) > 1e-3  # both terms carry gradient
    assert abs(float(pg)) > 1e-4 and float(kl_term) > 1e-4


def cfg(*overrides):
    return load_config(SMOKE, ["export=false", *overrides])


def teacher_folder(path, seed=7, vocab=259, tokenizer=None):
    """A saved tiny Llama (another seed: other weights than the policy's) with the byte tokenizer."""
    save_hf_folder(tiny_model("llama", vocab_size=vocab, seed=seed), tokenizer or byte_tokenizer(), path)
    return str(path)


@pytest.mark.parametrize("teacher_dtype", [None, "bfloat16"])
def test_the_trainers_kl_is_to_the_teacher(tmp_path, teacher_dtype):
    """The logged kl of a distillation update equals kl.token_kl on full logits of a plain forward of
    the teacher (the policy moved away from the sampler, the initial policy), also for a bfloat16 teacher
    beside a float32 policy; the EMA anchor still follows the policy."""
    teacher = teacher_folder(tmp_path / "teacher")
    tr = Trainer(cfg("steps=1", "eval.size=0", f"algo.teacher={teacher}", "algo.pg_coef=0", "algo.beta=1", "algo.k=4",
                     "mini_batch_prompts=null", "algo.eta=0.5", f"algo.teacher_dtype={teacher_dtype or 'null'}"),
                 tmp_path / "run", progress=False)
    assert {p.dtype for p in tr.run.teacher.parameters()} == {getattr(torch, teacher_dtype or "float32")}
    batch = tr.rollout(1)
    sampler = full_logits(tr.run.model, batch, 1.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.run.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    plain_teacher, _ = load_model(teacher, teacher_dtype or "float32")
    mask = batch.response_mask
    want = token_kl(full_logits(tr.run.model, batch, 1.0), full_logits(plain_teacher, batch, 1.0), batch.response_ids,
                    estimator="topk_reverse", k=4, sampling_logits=sampler)
    want = float((want * mask).sum() / mask.sum())
    w_before = next(tr.run.model.parameters()).detach().clone()
    row = tr.update(batch)
    # a bfloat16 forward rounds differently in the trainer's chunked, prefix-shared passes than in one plain
    # forward, and how much depends on the CPU's bf16 kernels (1.2e-4 relative on an AMD EPYC); the dtype
    # itself is checked on the parameters above, the tolerance only has to tell the teacher from the policy
    rel = 1e-4 if teacher_dtype is None else 1e-3
    assert want > 0.05 and row["kl"] == pytest.approx(want, rel=rel)
    assert row["grad_norm"] > 0
    assert not any(p.requires_grad for p in tr.run.teacher.parameters())
    with tr.run.anchor.use(tr.run.model) as m:  # eta 0.5: the anchor moved halfway from the start to the policy
        assert not torch.equal(next(m.parameters()), w_before)


def test_a_teacher_equal_to_the_frozen_anchor_gives_the_same_run(tmp_path):
    """GRPO's frozen reference (eta = 1) and a teacher that is the same initial model are one loss."""
    init = tmp_path / "init"
    from emapg.models.zoo import load_model

    model, tok = load_model("tiny-llama", seed=0)
    save_hf_folder(model, tok, init)
    common = ("steps=2", "eval.size=0", "save_every=0", "algo.beta=0.5")
    Trainer(cfg(*common, "algo.eta=1.0"), tmp_path / "frozen", progress=False).train()
    Trainer(cfg(*common, "algo.eta=0.9", f"algo.teacher={init}"), tmp_path / "teacher", progress=False).train()
    a, b = strip_timing(read_metrics(tmp_path / "frozen")), strip_timing(read_metrics(tmp_path / "teacher"))
    for ra, rb in zip(a, b, strict=True):
        for key in ("pg_loss", "kl", "reward_mean", "grad_norm", "clip_frac"):  # each in every row
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-9), key
    assert a[-1]["kl"] > 0


def test_lora_student_distils(tmp_path):
    teacher = teacher_folder(tmp_path / "teacher")
    tr = Trainer(cfg("steps=2", "eval.size=0", "save_every=0", f"algo.teacher={teacher}", "algo.pg_coef=0",
                     "algo.beta=1", "lora.r=4", "lora.target_modules=[q_proj,v_proj]", "lr=1e-2"),
                 tmp_path / "run", progress=False)
    lora = {n: p.detach().clone() for n, p in tr.run.model.named_parameters() if "lora_B" in n}
    tr.train()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all(r["kl"] > 0 and r["grad_norm"] > 0 for r in rows)
    moved = [n for n, p in tr.run.model.named_parameters() if n in lora and not torch.equal(p, lora[n])]
    assert lora and len(moved) == len(lora)  # every adapter learned (B starts at 0: the KL's gradient moved it)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    other = byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<tool>"]})  # one id more
    bad = teacher_folder(tmp_path / "other", vocab=260, tokenizer=other)
    with pytest.raises(ConfigError, match=r"algo.teacher: .* has another tokenizer than the policy 'tiny-llama' "
                                          r"\(259 vs 260 tokens; 0 only in the policy's, 1 only in the teacher's"):
        Trainer(cfg(f"algo.teacher={bad}"), tmp_path / "a", progress=False)
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="algo.teacher: .*nowhere.* is neither a built-in name"):
        Trainer(cfg(f"algo.teacher={tmp_path / 'nowhere'}"), tmp_path / "b", progress=False)
    with pytest.raises(ConfigError, match="algo.teacher_dtype: expected float32, bfloat16, float16 or null"):
        cfg(f"algo.teacher={bad}", "algo.teacher_dtype=bf16")
    small = teacher_folder(tmp_path / "small", vocab=200)
    with pytest.raises(ConfigError, match="scores 200 token ids, fewer than the policy's 259"):
        Trainer(cfg(f"algo.teacher={small}"), tmp_path / "c", progress=False)


def test_an_untied_padded_teacher_is_cut_to_the_policys_rows(tmp_path):
    """Untied head (as Qwen2.5-7B/72B): after the cut, the teacher's logits are its first 259 original ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from emapg.models.zoo import load_model

    torch.manual_seed(3)
    untied = LlamaForCausalLM(LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                          bos_token_id=0, eos_token_id=1, pad_token_id=1))
    save_hf_folder(untied, byte_tokenizer(), tmp_path / "untied")
    tr = Trainer(cfg(f"algo.teacher={tmp_path / 'untied'}", "steps=1", "eval.size=0"), tmp_path / "run",
                 progress=False)
    original, _ = load_model(str(tmp_path / "untied"))
    ids = torch.tensor([[5, 70, 120, 200, 258]])
    with torch.no_grad():
        cut, full = tr.run.teacher(input_ids=ids).logits, original(input_ids=ids).logits
    assert cut.shape[-1] == 259 and not tr.run.teacher.config.tie_word_embeddings
    torch.testing.assert_close(cut, full[..., :259])


def test_a_padded_teacher_vocabulary_is_cut_to_the_policys(tmp_path):
    """Same tokenizer, more output rows (padding, as between Qwen2.5 sizes): the rows beyond the policy's are
    dropped, so both distributions are over the same ids."""
    padded = teacher_folder(tmp_path / "padded", vocab=272)
    tr = Trainer(cfg(f"algo.teacher={padded}", "steps=1", "eval.size=0"), tmp_path / "run", progress=False)
    assert tr.run.teacher.get_output_embeddings().weight.shape[0] == 259
    assert tr.train_step(1)["kl"] > 0


def test_a_resume_refuses_a_teacher_whose_weights_changed(tmp_path):
    """The checkpoint records the teacher's sha256: the same teacher resumes to the uninterrupted run;
    one retrained in place is refused (nothing written), and accepted with force, recorded."""
    teacher = tmp_path / "teacher"
    teacher_folder(teacher)
    common = ("eval.size=0", "save_every=1", f"algo.teacher={teacher}", "algo.beta=0.5")
    Trainer(cfg("steps=2", *common), tmp_path / "whole", progress=False).train()
    Trainer(cfg("steps=1", *common), tmp_path / "run", progress=False).train()
    tr = Trainer(cfg("steps=2", *common), tmp_path / "run", resume=True, progress=False)
    assert tr.run.teacher_sha256 == weights_digest(load_model(str(teacher))[0])
    tr.train()
    assert strip_timing(read_metrics(tmp_path / "run")) == strip_timing(read_metrics(tmp_path / "whole"))

    teacher_folder(teacher, seed=8)  # retrained in place: same name, other weights
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=r"--resume .*run: algo.teacher .* has other weights than the teacher "
                                          r"this run was trained with .*pass --force"):
        Trainer(cfg("steps=3", *common), tmp_path / "run", resume=True, progress=False)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before
    assert not (tmp_path / "run" / "resumes.jsonl").exists()
    tr = Trainer(cfg("steps=3", *common), tmp_path / "run", resume=True, progress=False, force=True)
    (entry,) = [json.loads(line) for line in open(tmp_path / "run" / "resumes.jsonl")]
    assert entry["forced"] and entry["changed"]["teacher_sha256"][1] == tr.run.teacher_sha256
    tr.train()
    assert tr.save() and load_checkpoint(latest_checkpoint(tmp_path / "run"))["state"]["teacher_sha256"] == \
        tr.run.teacher_sha256


def test_the_weights_digest_sees_one_changed_value():
    model = tiny_model("llama", vocab_size=V, seed=0)
    a = weights_digest(model)
    assert weights_digest(tiny_model("llama", vocab_size=V, seed=0)) == a
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3
    assert weights_digest(model) != a
    assert weights_digest(model.to(torch.bfloat16)) != weights_digest(model.to(torch.float32))


def test_the_teacher_kl_endpoint_is_the_exact_reverse_kl_on_the_teachers_own_responses(tmp_path):
    """eval.teacher_kl: at each held-out evaluation, the mean over the teacher's greedy responses' tokens of
    KL(model || teacher) over the whole vocabulary equals a plain forward's full logits; the responses are
    the teacher's greedy ones, made once and the same at every evaluation; a model equal to the teacher
    scores exactly 0."""
    from emapg.rollout.sampling import SamplingSpec
    from emapg.run.teacher_kl import TeacherKL, reverse_kl_sum

    teacher_dir = teacher_folder(tmp_path / "teacher")
    tr = Trainer(cfg("steps=2", "eval.size=6", "eval.every=1", "save_every=0", f"algo.teacher={teacher_dir}",
                     "algo.pg_coef=0", "algo.beta=1", "algo.k=4", "rollout.temperature=0.7"), tmp_path / "run",
                 progress=False)
    tkl = tr.run.evaluator.teacher_kl
    assert isinstance(tkl, TeacherKL) and len(tkl.examples) == 6 and tkl.temperature == 0.7
    value = tkl(tr.run.model)
    responses = [b.response_ids.clone() for b in tkl.batches]
    from emapg.rollout import rollout_for_task

    greedy = rollout_for_task(tr.run.teacher, tr.run.tokenizer, tr.run.task, tkl.examples,
                              SamplingSpec(n=1, greedy=True, max_new_tokens=tkl.max_new_tokens))
    assert torch.equal(torch.cat(responses), greedy.response_ids)  # the teacher's own greedy answers
    total, count = 0.0, 0
    for b in tkl.batches:
        s, t = full_logits(tr.run.model, b, 0.7).log_softmax(-1), full_logits(tr.run.teacher, b, 0.7).log_softmax(-1)
        per_pos = (s.exp() * (s - t)).sum(-1)
        total, count = total + float((per_pos * b.response_mask).sum()), count + int(b.response_mask.sum())
    assert value > 0.01 and value == pytest.approx(total / count, rel=1e-6)  # float32 passes, two paths
    assert reverse_kl_sum(tr.run.teacher, tr.run.teacher, tkl.batches[0], 0.7)[0] == 0.0
    tr.train()
    rows = read_metrics(tmp_path / "run")
    kls = [r["eval/policy_teacher_kl"] for r in rows if "eval/policy_teacher_kl" in r]
    assert len(kls) == 3 and kls[0] == pytest.approx(value, rel=1e-12) and kls[-1] != kls[0]
    assert [torch.equal(a, b.response_ids) for a, b in zip(responses, tkl.batches, strict=True)] == [True]
    assert "eval/anchor_teacher_kl" in rows[-1]


def test_teacher_kl_is_off_without_a_teacher_or_when_asked(tmp_path):
    tr = Trainer(cfg("steps=1", "eval.size=4", "save_every=0"), tmp_path / "a", progress=False)
    assert tr.run.evaluator.teacher_kl is None
    teacher_dir = teacher_folder(tmp_path / "teacher")
    tr = Trainer(cfg("steps=1", "eval.size=4", "save_every=0", f"algo.teacher={teacher_dir}", "algo.beta=1",
                     "eval.teacher_kl=false"), tmp_path / "b", progress=False)
    assert tr.run.evaluator.teacher_kl is None
