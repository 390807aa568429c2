"""Bounded rollouts (emapg.rollout.hf): at most max_rows rows decode at once and rows join as others
finish. Every recorded statistic equals a forward pass over the finished sequence (a wrong join, a
misplaced cache column or a wrong position would change it), greedy decoding gives the tokens of the
unbounded loop, and every row keeps its own budget."""

import random

import pytest
import torch

from emapg.models.forward import response_logprobs
from emapg.models.zoo import load_model
from emapg.rollout.hf import _right_aligned, generate
from emapg.rollout.sampling import SamplingSpec
from emapg.tasks import make_task


def _examples(n=7):
    examples = make_task("arithmetic", digits=2, terms=3, ops="+-").train_examples(random.Random(0), n)
    for i, ex in enumerate(examples):  # prompts of different lengths: left padding, columns to compact
        ex.messages[0]["content"] += " Think." * (i % 3)
    return examples


def _model(kind, seed):
    """A tiny random model where 1 token in 16 ends a row: rows end at many different steps."""
    model, tok = load_model(kind, seed=seed)
    model.generation_config.eos_token_id = list(range(3, model.config.vocab_size, 16))
    return model, tok


def test_right_alignment_keeps_each_rows_real_columns_in_order():
    mask = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 1]])
    idx = _right_aligned(mask)
    assert idx.shape == (3, 3)
    assert torch.equal(mask.gather(1, idx), torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1]]))
    assert idx[0].tolist() == [1, 3, 4] and idx[1, 1:].tolist() == [0, 1] and idx[2, 2] == 4


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("max_rows", [3, 8, 12])
def test_each_recorded_statistic_equals_a_forward_pass_over_the_finished_sequence(kind, max_rows):
    model, tok = _model(kind, 4)
    spec = SamplingSpec(n=3, temperature=0.8, top_p=1.0, max_new_tokens=14, k=5)
    torch.manual_seed(0)
    batch = generate(model, tok, _examples(), spec, max_rows=max_rows)
    assert batch.response_ids.shape[0] == 21
    valid = batch.response_mask.bool()
    lengths = batch.response_mask.sum(1)
    assert int(lengths.min()) < 14 and int(lengths.max()) == 14  # some rows ended early, others at the budget
    st = response_logprobs(model, batch, temperature=0.8, k_self=5, entropy=True, prefix_sharing=False)
    torch.testing.assert_close(batch.samp_logp[valid], st.logp_tok, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(batch.entropy[valid], st.entropy, atol=2e-5, rtol=1e-5)
    assert torch.equal(batch.samp_topk[valid], st.topk_ids)
    assert bool(batch.truncated.any()) and bool((lengths[batch.truncated] == 14).all())


def test_greedy_bounded_gives_the_unbounded_tokens_and_statistics():
    model, tok = _model("tiny-llama", 2)
    spec = SamplingSpec(n=1, temperature=0.7, greedy=True, max_new_tokens=12, k=3)
    free = generate(model, tok, _examples(9), spec)
    for max_rows in (1, 2, 4):
        bounded = generate(model, tok, _examples(9), spec, max_rows=max_rows)
        assert torch.equal(bounded.response_ids, free.response_ids)
        assert torch.equal(bounded.response_mask, free.response_mask)
        torch.testing.assert_close(bounded.samp_logp, free.samp_logp, atol=2e-5, rtol=1e-5)
        assert bounded.completions == free.completions


def test_a_bound_that_holds_every_row_changes_nothing():
    model, tok = _model("tiny-qwen2", 1)
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=10, k=2)
    torch.manual_seed(3)
    free = generate(model, tok, _examples(4), spec)
    torch.manual_seed(3)
    bounded = generate(model, tok, _examples(4), spec, max_rows=8)
    assert torch.equal(bounded.response_ids, free.response_ids)
    assert torch.equal(bounded.samp_logp, free.samp_logp)


def test_models_whose_cache_forgets_columns_decode_in_whole_prompt_batches(monkeypatch):
    from emapg.rollout import hf

    model, tok = _model("tiny-qwen2", 4)
    calls = []
    real = hf.decode

    def counting(model, ids, *args, **kwargs):
        calls.append(ids.shape[0])
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(hf, "decode", counting)
    monkeypatch.setattr(hf, "full_attention", lambda model: False)  # as for a sliding-window model
    spec = SamplingSpec(n=3, temperature=0.8, max_new_tokens=9, k=2)
    batch = generate(model, tok, _examples(5), spec, max_rows=6)
    assert calls == [6, 6, 3]
    assert int(batch.response_mask.sum(1).min()) < 9
    valid = batch.response_mask.bool()
    st = response_logprobs(model, batch, temperature=0.8, prefix_sharing=False)
    torch.testing.assert_close(batch.samp_logp[valid], st.logp_tok, atol=2e-5, rtol=1e-5)


def test_the_max_rows_field_reaches_training_rollouts_and_evaluation(tmp_path, monkeypatch):
    from pathlib import Path

    from emapg.config import load_config
    from emapg.rollout import hf
    from emapg.run.trainer import Trainer

    calls = []
    real = hf.decode_pool
    monkeypatch.setattr(hf, "decode_pool", lambda *a, **kw: calls.append(kw["max_rows"]) or real(*a, **kw))
    smoke = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"
    tr = Trainer(load_config(smoke, ["export=false", "eval.size=2", "eval.samples=3", "eval.greedy=false",
                                     "rollout.max_rows=2"]), tmp_path, progress=False)
    tr.rollout(1)
    assert calls == [2]
    tr.evaluate()
    assert calls == [2, 2]


def test_a_bounded_rollout_keeps_no_autograd_graph():
    """Called with gradients enabled (as the trainer's rollout is, outside FSDP), the bounded paths record
    nothing for a backward pass: every step's activations would otherwise stay alive to the end."""
    model, tok = _model("tiny-llama", 4)
    assert torch.is_grad_enabled()
    batch = generate(model, tok, _examples(4), SamplingSpec(n=2, max_new_tokens=6, k=2), max_rows=3)
    assert not batch.samp_logp.requires_grad and batch.samp_logp.grad_fn is None
    assert not batch.entropy.requires_grad
