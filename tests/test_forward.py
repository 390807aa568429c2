"""The prefix-shared training pass equals the plain full-sequence pass, in value and gradient."""

import random

import pytest
import torch

from emapg.models.forward import response_logprobs
from emapg.models.zoo import load_model
from emapg.rollout.hf import generate
from emapg.rollout.sampling import SamplingSpec
from emapg.tasks import make_task


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-qwen2"])
def test_prefix_sharing_equals_full_sequence_pass(kind):
    model, tok = load_model(kind, seed=1)
    task = make_task("arithmetic", digits=2, terms=3, ops="+-")
    examples = task.train_examples(random.Random(0), 3)  # prompts of different lengths: left padding
    examples[1].messages[0]["content"] += " Think about it."
    torch.manual_seed(0)
    batch = generate(model, tok, examples, SamplingSpec(n=3, temperature=0.9, max_new_tokens=12, k=4))
    assert batch.prompt_mask.sum(1).unique().numel() > 1
    outs, grads = [], []
    for sharing in (True, False):
        model.zero_grad()
        st = response_logprobs(model, batch, temperature=0.9, ids=batch.samp_topk[batch.response_mask.bool()],
                               prefix_sharing=sharing)
        (st.logp_tok.sum() + st.logp_ids.exp().sum()).backward()
        outs.append((st.logp_tok.detach(), st.logp_ids.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)
    # and the recomputed log-probs are the sampler's own (on-policy ratio = 1)
    torch.testing.assert_close(outs[0][0], batch.samp_logp[batch.response_mask.bool()], atol=1e-5, rtol=1e-5)


def test_response_mask_comes_from_each_rows_length_not_from_the_first_pad():
    from emapg.rollout.sampling import response_mask_from_lengths

    # pad = EOS = 1; row 3 stopped at its budget (length 2) and was padded: its pad is no EOS
    ids = torch.tensor([[5, 6, 1, 1, 1], [5, 1, 7, 1, 1], [5, 6, 7, 8, 9], [5, 6, 1, 1, 1]])
    mask, truncated = response_mask_from_lengths(ids, torch.tensor([3, 2, 5, 2]), [1])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, True]


def test_generate_with_shared_prompt_cache_equals_plain_generate():
    model, tok = load_model("tiny-llama", seed=3)
    examples = make_task("arithmetic", digits=2, terms=3, ops="+-").train_examples(random.Random(0), 3)
    examples[1].messages[0]["content"] += " Think."
    out = []
    for sharing in (True, False):
        torch.manual_seed(0)
        spec = SamplingSpec(n=3, temperature=0.9, max_new_tokens=10, k=4)
        out.append(generate(model, tok, examples, spec, prefix_sharing=sharing))
    assert torch.equal(out[0].response_ids, out[1].response_ids)
    assert torch.equal(out[0].samp_topk, out[1].samp_topk)
    torch.testing.assert_close(out[0].samp_logp, out[1].samp_logp, atol=1e-5, rtol=1e-5)
    assert out[0].prompt_ids.shape[0] == 3 and out[0].response_ids.shape[0] == 9


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-qwen2"])
def test_rows_grouped_by_length_equal_the_full_sequence_pass(kind):
    """Rows of very different lengths run in length groups, each trimmed to its own longest: the same
    log-probs and gradients as the plain pass, where every row runs the longest length."""
    from emapg.models.forward import _length_groups

    model, tok = load_model(kind, seed=2)
    model.generation_config.eos_token_id = list(range(1, 30))  # rows end at many different lengths
    examples = make_task("arithmetic", digits=2, terms=3, ops="+-").train_examples(random.Random(1), 4)
    torch.manual_seed(0)
    batch = generate(model, tok, examples, SamplingSpec(n=4, temperature=1.0, max_new_tokens=40, k=3))
    batch.response_mask[::2] = 0  # rows that count nowhere (algo.mask_truncated drops truncated ones)
    lengths = batch.response_mask.sum(1)
    assert len(_length_groups(lengths - 1, sliding=False)) > 1, lengths  # the grouped path runs
    outs, grads = [], []
    for sharing in (True, False):
        model.zero_grad()
        st = response_logprobs(model, batch, ids=batch.samp_topk[batch.response_mask.bool()], prefix_sharing=sharing)
        (st.logp_tok.sum() + st.logp_ids.exp().sum()).backward()
        outs.append(st.logp_tok.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-qwen2"])
def test_checkpointing_with_prefix_sharing_gives_the_plain_passes_values_and_gradients(kind):
    from emapg.models.lm import set_pass_mode

    model, tok = load_model(kind, seed=2)
    examples = make_task("arithmetic", digits=2, terms=3, ops="+-").train_examples(random.Random(1), 4)
    examples[2].messages[0]["content"] += " Think about it."
    model.generation_config.eos_token_id = list(range(3, model.config.vocab_size, 48))  # rows of many lengths
    torch.manual_seed(0)
    batch = generate(model, tok, examples, SamplingSpec(n=3, temperature=0.9, max_new_tokens=96, k=4))
    lengths = batch.response_mask.sum(1)
    assert int(lengths.min()) < 48 and int(lengths.max()) == 96  # several length groups
    ids = batch.samp_topk[batch.response_mask.bool()]
    results, saved = {}, {}
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for sharing in (False, True):
            set_pass_mode(model, grad=True)
            model.zero_grad()
            sizes = []

            def pack(t, sizes=sizes):
                sizes.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                st = response_logprobs(model, batch, temperature=0.9, ids=ids, prefix_sharing=sharing)
            (st.logp_tok.sum() + st.logp_ids.exp().sum()).backward()
            results[ckpt, sharing] = (st.logp_tok.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
            saved[ckpt, sharing] = sum(sizes)
            # the flags transformers reads are as the pass found them
            assert all(m.training == ckpt for m in model.model.layers)
            assert all("forward" not in m.__dict__ for m in model.model.layers)
    want_lp, want_g = results[False, False]
    for key, (lp, grads) in results.items():
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
        for name in want_g:
            torch.testing.assert_close(grads[name], want_g[name], atol=1e-5, rtol=1e-4, msg=f"{key} {name}")
    assert saved[True, True] < 0.5 * saved[False, True], saved  # the response pass really is checkpointed
