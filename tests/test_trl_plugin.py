"""emapg.integrations.trl against real TRL on a tiny random model: the loss equals GRPOTrainer's
where they coincide, the reference follows the EMA's closed form (adapters only under LoRA), the
top-k term equals emapg's estimator on full logits, and resuming keeps the EMA reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from emapg import kl as klmod  # noqa: E402
from emapg.integrations.trl import EMA_FILE, EMAPGTrainer  # noqa: E402
from emapg.models.zoo import load_model, save_hf_folder  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    model, tok = load_model("tiny-llama", "float32", seed=0)
    path = tmp_path_factory.mktemp("tiny") / "model"
    save_hf_folder(model, tok, path)
    return str(path)


def dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"add {i} and {i + 1}"}] for i in range(n)]})


def reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


def config(out: Path, **kw) -> GRPOConfig:
    base = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                max_steps=2, learning_rate=1e-2, beta=0.1, report_to=[], use_cpu=True, logging_steps=1,
                save_strategy="no", seed=0, temperature=1.0, bf16=False)
    return GRPOConfig(**{**base, **kw})


def make(cls, tiny, out, tokenizer=None, **kw):
    from transformers import AutoTokenizer

    args = {k: kw.pop(k) for k in list(kw) if k in GRPOConfig.__dataclass_fields__}
    tok = tokenizer or AutoTokenizer.from_pretrained(tiny)
    return cls(tiny, [reward], args=config(out, **args), train_dataset=dataset(), processing_class=tok, **kw)


def batch_of(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    return trainer._generate_and_score_completions([dataset()[i] for i in range(4)])


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("estimator,bias_correction", [("k3", False), ("k3pp", True)])
def test_eta_one_k3_equals_grpo_trainer_with_beta(tiny, tmp_path, loss_type, estimator, bias_correction):
    """TRL's k3 (times the ratio when use_bias_correction_kl) is emapg's k3 (k3pp): same loss, same
    gradients, on the same batch, under every aggregation."""
    ours = make(EMAPGTrainer, tiny, tmp_path / "a", eta=1.0, kl=estimator, loss_type=loss_type,
                use_bias_correction_kl=bias_correction)
    theirs = make(GRPOTrainer, tiny, tmp_path / "b", loss_type=loss_type, use_bias_correction_kl=bias_correction)
    inputs = batch_of(ours)
    with torch.no_grad():  # the policy moves away from the reference, so the KL term is not zero
        for p, q in zip(ours.model.parameters(), theirs.model.parameters(), strict=True):
            p.add_(0.05 * torch.randn_like(p))
            q.copy_(p)
    loss_a, grads_a = loss_and_grads(ours, inputs)
    loss_b, grads_b = loss_and_grads(theirs, inputs)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)
    assert ours._metrics["train"]["kl"][-1] == pytest.approx(theirs._metrics["train"]["kl"][-1], rel=1e-5)
    assert ours._metrics["train"]["kl"][-1] > 1e-4


def full_logits(model, inputs, temperature):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    c = inputs["completion_ids"].shape[1]
    return model(input_ids=ids, attention_mask=att).logits[:, -c - 1 : -1].double() / temperature


@pytest.mark.parametrize("estimator", ["topk_forward", "topk_reverse"])
@pytest.mark.parametrize("form", klmod.FORMS)
def test_topk_term_equals_emapgs_estimator_on_full_logits(tiny, tmp_path, estimator, form):
    _topk_term_equals(tiny, tmp_path, estimator, form, "anchor")


@pytest.mark.parametrize("head", ["sampler", "union"])
@pytest.mark.parametrize("form", ["unbiased", "residual", "bucket"])
def test_every_head_equals_emapgs_estimator_on_full_logits(tiny, tmp_path, head, form):
    """head='sampler' and 'union': the policy's own top-k at generation (before it moved), and the
    reference's log-probs there, give emapg.kl's estimate with that head, in value and gradient."""
    _topk_term_equals(tiny, tmp_path, "topk_reverse", form, head)


def _topk_term_equals(tiny, tmp_path, estimator, form, head):
    """The per-token KL from TRL's passes (the head's ids found in the reference pass, or the policy's at
    generation; the policy's log-probs at those ids from its hidden states) equals emapg.kl on the models'
    full logits with that head, in value and gradient (topk_reverse with the reference's top-k stays
    unbiased: any head not chosen by the token)."""
    tr = make(EMAPGTrainer, tiny, tmp_path, eta=0.5, kl=estimator, k=5, form=form, head=head, temperature=0.7)
    inputs = batch_of(tr)
    with torch.no_grad():
        before = full_logits(tr.model, inputs, 0.7)  # the policy that sampled: the sampler's head is its top-k
        for p in tr.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tr._capture = []
    logp, _, _ = tr._get_per_token_logps_and_entropies(
        tr.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].shape[1])
    (logp, hidden), = tr._capture
    tr._capture = None
    got = tr._token_kl(tr.model, inputs, logp, hidden)
    policy = full_logits(tr.model, inputs, 0.7)
    with torch.no_grad():
        anchor = full_logits(tr.ref_model, inputs, 0.7)
    tokens = inputs["completion_ids"]
    ids, mask = klmod.choose_head(head, 5, before, anchor)
    assert torch.equal(ids, inputs["ref_head_ids"])
    if head == "anchor":
        want = klmod.token_kl(policy, anchor, tokens, estimator=estimator, k=5, form=form, head="anchor")
    else:  # the head is the policy's before the update, which token_kl would take from the moved policy
        lp, la = policy.log_softmax(-1), anchor.log_softmax(-1)
        g = lambda t, i: t.gather(-1, i)  # noqa: E731
        want = klmod.kl_from_logprobs(estimator, g(lp, tokens[..., None])[..., 0], g(la, tokens[..., None])[..., 0],
                                      policy_logp_q=g(lp, ids), anchor_logp_q=g(la, ids), head_mask=mask,
                                      in_q=klmod.in_head(ids, tokens), form=form)
        torch.testing.assert_close(inputs["ref_head_logps"].double(), g(la, ids), rtol=1e-4, atol=1e-6)
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(got[mask].double(), want[mask], rtol=1e-4, atol=1e-6)
    params = [p for p in tr.model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad(got[mask].sum(), params, allow_unused=True)
    g_want = torch.autograd.grad(want[mask].sum(), params, allow_unused=True)
    for a, b in zip(g_got, g_want, strict=True):
        if a is None or b is None:
            assert a is None and b is None or float((a if b is None else b).abs().max()) == 0
            continue
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=2e-5)  # fp32 model passes


def test_vllm_importance_weight_and_its_unscored_tokens(tiny, tmp_path):
    """Under vLLM the KL's weight is s = pi / pi_samp (vLLM's log-probs); a token vLLM could not
    score (NaN) is weighed by pi_old instead, and the term stays finite."""
    tr = make(EMAPGTrainer, tiny, tmp_path, eta=0.5, kl="k3")
    inputs = batch_of(tr)
    logp = inputs["ref_per_token_logps"] + 0.1
    hidden = torch.zeros(*logp.shape, 64)
    samp = inputs["ref_per_token_logps"].clone()
    samp[0, 0] = float("nan")
    tr.use_vllm = True
    got = tr._token_kl(tr.model, {**inputs, "sampling_per_token_logps": samp}, logp, hidden)
    tr.use_vllm = False
    k3 = klmod.ESTIMATORS["k3"].sample(logp, inputs["ref_per_token_logps"])
    want = torch.exp(logp - samp) * k3
    want[0, 0] = k3[0, 0]  # no pi_old in this batch: the policy's own log-prob, s = 1
    torch.testing.assert_close(got, want)


class Record(TrainerCallback):
    """The trainable parameters after each optimizer step (runs after EMAPGTrainer's EMA update)."""

    def __init__(self, trainer):
        self.trainer, self.seen = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append({n: p.detach().double().clone() for n, p in self.trainer.model.named_parameters()
                          if p.requires_grad})


def closed_form(theta0, thetas, eta):
    """theta_ema after n updates: eta^n theta_0 + sum_j (1 - eta) eta^(n - j) theta_j."""
    n = len(thetas)
    return {k: eta**n * theta0[k] + sum((1 - eta) * eta ** (n - j) * t[k] for j, t in enumerate(thetas, 1))
            for k in theta0}


def test_reference_follows_the_emas_closed_form(tiny, tmp_path):
    tr = make(EMAPGTrainer, tiny, tmp_path, eta=0.6, max_steps=3)
    theta0 = {n: p.detach().double().clone() for n, p in tr.model.named_parameters()}
    rec = Record(tr)
    tr.add_callback(rec)
    tr.train()
    want = closed_form(theta0, rec.seen, 0.6)
    ref = dict(tr.ref_model.named_parameters())
    moved = 0.0
    for name, value in want.items():
        torch.testing.assert_close(ref[name].double(), value.double(), rtol=0, atol=1e-6)
        moved = max(moved, float((value - theta0[name]).abs().max()))
    assert moved > 1e-3 and tr.anchor.num_updates == 3


def test_a_bf16_policy_keeps_an_fp32_average(tiny, tmp_path):
    tr = make(EMAPGTrainer, tiny, tmp_path, eta=0.9, max_steps=2, model_init_kwargs={"dtype": torch.bfloat16})
    tr.train()
    ref = dict(tr.ref_model.named_parameters())
    assert all(avg.dtype == torch.float32 for avg in tr.anchor.average.values())
    assert all(p.dtype == torch.bfloat16 for p in ref.values())
    for name, avg in tr.anchor.average.items():
        if name in ref:
            assert torch.equal(ref[name], avg.to(torch.bfloat16))  # the reference is the rounded average
    # (1 - eta) times a bf16 step is below bf16's resolution for most weights: only fp32 keeps it
    assert any(not torch.equal(avg, avg.to(torch.bfloat16).float()) for avg in tr.anchor.average.values())


def test_lora_reference_is_the_base_plus_an_ema_of_the_adapters(tiny, tmp_path):
    from peft import LoraConfig

    tr = make(EMAPGTrainer, tiny, tmp_path, eta=0.5, max_steps=3,
              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert tr.ref_model is None  # no second copy of the base
    policy = tr.model
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad and "lora_" not in n}
    adapters0 = {n: p.detach().double().clone() for n, p in policy.named_parameters() if p.requires_grad}
    rec = Record(tr)
    tr.add_callback(rec)
    tr.train()
    assert all(torch.equal(p, frozen[n]) for n, p in policy.named_parameters() if n in frozen)  # base untouched
    want = closed_form(adapters0, rec.seen, 0.5)
    params = dict(policy.named_parameters())
    for name, value in want.items():
        ref = params[name.replace(".default.", ".ref.")]
        assert not ref.requires_grad
        torch.testing.assert_close(ref.double(), value.double(), rtol=0, atol=1e-6)
    # what the reference costs: the ref adapter's tensors, a small fraction of the model
    ref_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if ".ref." in n)
    adapter_bytes = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
    base_bytes = sum(t.numel() * t.element_size() for t in frozen.values())
    assert ref_bytes == adapter_bytes and ref_bytes < 0.05 * base_bytes


def test_resume_keeps_the_ema_reference(tiny, tmp_path):
    whole = make(EMAPGTrainer, tiny, tmp_path / "whole", eta=0.5, max_steps=3)
    whole.train()
    part = make(EMAPGTrainer, tiny, tmp_path / "part", eta=0.5, max_steps=3, save_strategy="steps", save_steps=2)
    part.train()
    ckpt = tmp_path / "part" / "checkpoint-2"
    assert (ckpt / EMA_FILE).exists()
    resumed = make(EMAPGTrainer, tiny, tmp_path / "part", eta=0.5, max_steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.anchor.num_updates == 3
    for (name, a), b in zip(whole.ref_model.named_parameters(), resumed.ref_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_bad_combinations_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="beta is 0"):
        make(EMAPGTrainer, tiny, tmp_path, beta=0.0)
    with pytest.raises(ValueError, match="sync_ref_model"):
        make(EMAPGTrainer, tiny, tmp_path, sync_ref_model=True)
    with pytest.raises(ValueError, match="EMAPGTrainer: kl: expected an estimator"):
        make(EMAPGTrainer, tiny, tmp_path, kl="k7")
    with pytest.raises(ValueError, match="every vocabulary id"):
        make(EMAPGTrainer, tiny, tmp_path, kl="exact_reverse")
    with pytest.raises(ValueError, match="EMAPGTrainer: k=100000 is more than the model's vocabulary"):
        make(EMAPGTrainer, tiny, tmp_path, k=100_000)
    for bad in (dict(eta=0.0), dict(eta=1.5), dict(ema_every=0), dict(k=-1), dict(form="Paper")):
        with pytest.raises(ValueError, match=f"EMAPGTrainer: {next(iter(bad))}: "):  # refused before any model is built
            make(EMAPGTrainer, tiny, tmp_path, **bad)
    with pytest.raises(ValueError, match="EMAPGTrainer: form='bucket' is a top-k estimator's tail; k3 is defined in "
                                         "unbiased, paper"):
        make(EMAPGTrainer, tiny, tmp_path, kl="k3", form="bucket")


def test_task_reward_scores_with_the_tasks_own_reward():
    from emapg.integrations.trl import task_reward
    from emapg.tasks import make_task
    from emapg.tasks.base import Example, Task

    task = make_task("arithmetic")
    ex = task.train_examples(__import__("random").Random(0), 1)[0]
    right, wrong = f"so it is {ex.answer}", f"so it is {ex.answer + 1}"
    fn = task_reward(task)
    # chat completions (a list of messages, the last one the model's) and plain text both
    chat = [[{"role": "assistant", "content": right}], [{"role": "assistant", "content": wrong}]]
    assert fn(chat, answer=[ex.answer, ex.answer]) == [1.0, 0.0]
    assert fn([wrong, right], answer=[ex.answer, ex.answer]) == [0.0, 1.0]

    class Seen(Task):  # the per-sample columns reach the reward as the example's meta
        def reward(self, completion, example: Example) -> float:
            return float(example.meta["weight"]) * (completion == example.answer)

    assert task_reward(Seen())(["a", "b"], answer=["a", "a"], weight=[2, 3], trainer_state=None) == [2.0, 0.0]
    assert task_reward(Seen()).__name__ == "Seen_reward"


# ---- on-policy distillation: teacher= -------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """Another tiny model with the policy's tokenizer (other weights: seed 1)."""
    model, tok = load_model("tiny-llama", "float32", seed=1)
    path = tmp_path_factory.mktemp("teacher") / "model"
    save_hf_folder(model, tok, path)
    return str(path)


def test_the_teacher_is_the_kl_reference_in_value_and_gradient(tiny, teacher, tmp_path):
    """With teacher= TRL's reference pass runs on the teacher (no copy of the policy is built), and the
    KL term equals emapg.kl on the policy's and the teacher's full logits, in value and gradient;
    pg_coef = 0 leaves beta times that term, aggregated as GRPO does, as the whole loss."""
    tr = make(EMAPGTrainer, tiny, tmp_path, teacher=teacher, kl="topk_reverse", k=5, temperature=0.7, pg_coef=0.0)
    want_teacher, _ = load_model(teacher, "float32", seed=0)
    got_teacher = tr.accelerator.unwrap_model(tr.ref_model)
    assert tr.anchor is None and len(tr.teacher_sha256) == 64
    for (name, a), b in zip(want_teacher.state_dict().items(), got_teacher.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the teacher itself, not the policy
    inputs = batch_of(tr)
    policy = full_logits(tr.model, inputs, 0.7)
    with torch.no_grad():
        tlog = full_logits(want_teacher, inputs, 0.7)
    tokens, mask = inputs["completion_ids"], inputs["completion_mask"].bool()
    lp, lt = policy.log_softmax(-1), tlog.log_softmax(-1)
    g = lambda t, i: t.gather(-1, i)  # noqa: E731
    torch.testing.assert_close(inputs["ref_per_token_logps"][mask].double(), g(lt, tokens[..., None])[..., 0][mask],
                               rtol=1e-4, atol=1e-5)
    ids = tlog.topk(5, -1).indices
    assert torch.equal(ids[mask], inputs["ref_head_ids"][mask])  # the teacher's own top-k
    want = klmod.kl_from_logprobs("topk_reverse", g(lp, tokens[..., None])[..., 0], g(lt, tokens[..., None])[..., 0],
                                  policy_logp_q=g(lp, ids), anchor_logp_q=g(lt, ids), in_q=klmod.in_head(ids, tokens))
    m = mask.double()
    want_loss = 0.1 * ((want * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    loss = tr.compute_loss(tr.model, inputs)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-4, atol=1e-7)
    params = [p for p in tr.model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad(loss, params, allow_unused=True)
    g_want = torch.autograd.grad(want_loss, params, allow_unused=True)
    for a, b in zip(g_got, g_want, strict=True):
        if a is not None and b is not None:
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=2e-6)


def test_a_lora_student_distils_from_a_frozen_teacher(tiny, teacher, tmp_path):
    from peft import LoraConfig

    tr = make(EMAPGTrainer, tiny, tmp_path, teacher=teacher, max_steps=2,
              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ref = tr.accelerator.unwrap_model(tr.ref_model)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    assert "ref" not in tr.model.peft_config  # no EMA adapter either
    tr.train()
    assert all(torch.equal(p, before[n]) for n, p in ref.named_parameters())
    assert tr.state.log_history[0]["kl"] > 0


def test_a_resume_keeps_the_teacher_and_refuses_another(tiny, teacher, tmp_path):
    whole = make(EMAPGTrainer, tiny, tmp_path / "whole", teacher=teacher, max_steps=3)
    whole.train()
    part = make(EMAPGTrainer, tiny, tmp_path / "part", teacher=teacher, max_steps=3, save_strategy="steps",
                save_steps=2)
    part.train()
    ckpt = tmp_path / "part" / "checkpoint-2"
    assert (ckpt / "emapg_teacher.json").exists() and not (ckpt / EMA_FILE).exists()
    resumed = make(EMAPGTrainer, tiny, tmp_path / "part", teacher=teacher, max_steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    other, tok = load_model("tiny-llama", "float32", seed=2)
    save_hf_folder(other, tok, tmp_path / "other")
    refused = make(EMAPGTrainer, tiny, tmp_path / "part", teacher=str(tmp_path / "other"), max_steps=3)
    with pytest.raises(ValueError, match="trained against a teacher with weights sha256"):
        refused.train(resume_from_checkpoint=str(ckpt))


def test_teachers_that_do_not_fit_are_refused(tiny, teacher, tmp_path):
    model, tok = load_model("tiny-llama", "float32", seed=1)
    rows = model.get_output_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows + 8)  # vocabulary padding, as between Qwen2.5 sizes: cut to the policy's
    save_hf_folder(model, tok, tmp_path / "padded")
    tr = make(EMAPGTrainer, tiny, tmp_path / "a", teacher=str(tmp_path / "padded"))
    assert tr.accelerator.unwrap_model(tr.ref_model).get_output_embeddings().weight.shape[0] == rows
    tok.add_tokens(["<not-in-the-policy>"])
    model.resize_token_embeddings(rows + 8)
    save_hf_folder(model, tok, tmp_path / "other-tok")
    with pytest.raises(ValueError, match="has another tokenizer than the policy"):
        make(EMAPGTrainer, tiny, tmp_path / "b", teacher=str(tmp_path / "other-tok"))
    with pytest.raises(ValueError, match="with a teacher .* drop eta"):
        make(EMAPGTrainer, tiny, tmp_path / "c", teacher=teacher, eta=0.9)
    with pytest.raises(ValueError, match="EMAPGTrainer: teacher_dtype: expected float32, bfloat16, float16"):
        make(EMAPGTrainer, tiny, tmp_path / "d", teacher=teacher, teacher_dtype="fp8")
    with pytest.raises(ValueError, match="EMAPGTrainer: teacher: "):
        make(EMAPGTrainer, tiny, tmp_path / "e", teacher=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="EMAPGTrainer: pg_coef"):
        make(EMAPGTrainer, tiny, tmp_path / "f", teacher=teacher, pg_coef=-1.0)


def test_a_loaded_teacher_is_checked_against_its_tokenizer_when_given(tiny, teacher, tmp_path):
    """A teacher passed as a loaded model: with teacher_tokenizer= its vocabulary is checked id by id as a
    folder's is (another is refused); without it a warning says nothing checked it."""
    import warnings

    model, tok = load_model(teacher, "float32", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the right tokenizer: no warning about it
        tr = make(EMAPGTrainer, tiny, tmp_path / "a", teacher=model, teacher_tokenizer=tok)
    assert len(tr.teacher_sha256) == 64
    with pytest.warns(UserWarning, match="no teacher_tokenizer was given"):
        make(EMAPGTrainer, tiny, tmp_path / "b", teacher=load_model(teacher, "float32", seed=0)[0])
    tok.add_tokens(["<not-in-the-policy>"])
    with pytest.raises(ValueError, match="has another tokenizer than the policy"):
        make(EMAPGTrainer, tiny, tmp_path / "c", teacher=load_model(teacher, "float32", seed=0)[0],
             teacher_tokenizer=tok)
    with pytest.raises(ValueError, match="teacher_tokenizer is for a loaded teacher"):
        make(EMAPGTrainer, tiny, tmp_path / "d", teacher=teacher, teacher_tokenizer=tok)


def test_two_processes_under_ddp_keep_one_reference(tiny, teacher, tmp_path):
    """torchrun, 2 processes (gloo): the EMA reference follows the closed form of the synchronised policy
    on both ranks alike, and a teacher stays itself on both while the student trains."""
    import json

    from safetensors.torch import load_file
    from test_distributed import run  # the launcher (torchrun) and environment of the distributed tests

    run(2, tiny, teacher, str(tmp_path), worker=Path(__file__).resolve().parent / "trl_ddp_worker.py", timeout=600)
    initial = load_model(tiny, "float32", seed=0)[0]
    theta0 = initial.state_dict()
    want_teacher = load_model(teacher, "float32", seed=0)[0].state_dict()
    for mode in ("ema", "teacher"):
        info = [json.loads((tmp_path / f"{mode}{r}.json").read_text()) for r in (0, 1)]
        assert all(i["processes"] == 2 and i["steps"] == 3 and i["distributed_type"].endswith("MULTI_CPU")
                   for i in info), info
        a, b = (load_file(tmp_path / f"{mode}{r}.safetensors") for r in (0, 1))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), mode  # one policy, one reference
        policy = {k.removeprefix("policy."): v for k, v in a.items() if k.startswith("policy.")}
        ref = {k.removeprefix("ref."): v for k, v in a.items() if k.startswith("ref.")}
        assert set(policy) == set(ref) == set(dict(initial.named_parameters()))
        assert max(float((policy[n] - theta0[n]).abs().max()) for n in policy) > 1e-3  # it trained
        if mode == "ema":
            for name in ref:
                torch.testing.assert_close(ref[name], a[f"want.{name}"], rtol=0, atol=1e-6)
            assert max(float((ref[n] - theta0[n]).abs().max()) for n in ref) > 1e-4  # and the reference moved
        else:
            assert all(torch.equal(ref[n], want_teacher[n]) for n in ref)


class _Record(TrainerCallback):
    """The policy's trainable weights after each optimizer step (a callback added before the weight EMA's: it
    sees the same weights)."""

    def __init__(self):
        self.after: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_weight_ema_callback_averages_a_plain_grpo_trainer_and_exports_it(tiny, tmp_path, lora):
    """A plain GRPOTrainer with WeightEMACallback(0.5): after 3 steps the average is the closed form of the policy's
    weights after each step (only the adapters under LoRA), and output_dir/ema is that model, merged."""
    from transformers import AutoModelForCausalLM

    from emapg.integrations.trl import WeightEMACallback

    kw = {}
    if lora:
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    tr = make(GRPOTrainer, tiny, tmp_path, max_steps=3, **kw)
    rec, cb = _Record(), WeightEMACallback(0.5)
    tr.add_callback(rec)
    tr.add_callback(cb)
    start = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.train()
    assert set(start) <= set(cb.ema.average) and (not lora or set(cb.ema.average) == set(start))
    assert not lora or all("lora_" in n for n in start)
    for name, first in start.items():
        expect = first
        for after in rec.after:
            expect = 0.5 * expect + 0.5 * after[name]
        torch.testing.assert_close(cb.ema.average[name], expect, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(cb.ema.average[n], rec.after[-1][n]) for n in start)  # it lags the policy
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ema").state_dict()
    with cb.use(tr.model) as m:
        import copy

        merged = copy.deepcopy(m).merge_and_unload() if lora else m  # (merging a copy: the policy keeps its own)
        for name, t in merged.state_dict().items():
            if name in exported:
                torch.testing.assert_close(exported[name], t, rtol=0, atol=1e-6, msg=name)


def test_the_weight_ema_callback_resumes_exactly_and_refuses_a_checkpoint_without_it(tiny, tmp_path):
    from emapg.integrations.trl import WEIGHT_EMA_FILE, WeightEMACallback

    whole = make(GRPOTrainer, tiny, tmp_path / "whole", max_steps=3)
    whole.add_callback(w := WeightEMACallback(0.5, export=False))
    whole.train()
    part = make(GRPOTrainer, tiny, tmp_path / "part", max_steps=3, save_strategy="steps", save_steps=2)
    part.add_callback(WeightEMACallback(0.5, export=False))
    part.train()
    ckpt = tmp_path / "part" / "checkpoint-2"
    assert (ckpt / WEIGHT_EMA_FILE).exists()
    resumed = make(GRPOTrainer, tiny, tmp_path / "part", max_steps=3)
    resumed.add_callback(r := WeightEMACallback(0.5, export=False))
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert r.ema.num_updates == 3
    for name, a in w.ema.average.items():
        torch.testing.assert_close(r.ema.average[name], a, rtol=0, atol=1e-6, msg=name)
    (ckpt / WEIGHT_EMA_FILE).unlink()
    again = make(GRPOTrainer, tiny, tmp_path / "part", max_steps=3)
    again.add_callback(WeightEMACallback(0.5, export=False))
    with pytest.raises(FileNotFoundError, match="holds no weight EMA"):
        again.train(resume_from_checkpoint=str(ckpt))
    with pytest.raises(ValueError, match="WeightEMACallback: decay: must be in \\(0, 1\\)"):
        WeightEMACallback(1.0)


def test_task_reward_zeroes_a_truncated_completion_where_the_task_does(tmp_path):
    """The math task under the reference grader scores a response that ran out of tokens 0 (rLLM's rule, the
    recipes'): through TRL the truncation is read off completion_ids (no EOS at its end); without the EOS id the
    reward is refused rather than silently scoring truncated answers."""
    import json

    from emapg.config import ConfigError
    from emapg.integrations.trl import task_reward
    from emapg.tasks import make_task

    data = tmp_path / "set.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    task = make_task("math", train_file=str(data), eval_file=str(data), grader="reference")
    with pytest.raises(ConfigError, match="pass eos_token_id"):
        task_reward(task)
    fn = task_reward(task, eos_token_id=0)
    right = "</think>\\boxed{2}"
    assert fn([right, right], answer=["2", "2"], completion_ids=[[5, 6, 0], [5, 6, 7]]) == [1.0, 0.0]
    lenient = make_task("math", train_file=str(data), eval_file=str(data))
    assert task_reward(lenient)([right], answer=["2"], completion_ids=[[5, 6, 7]]) == [1.0]  # it does not zero them
