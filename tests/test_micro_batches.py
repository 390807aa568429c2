"""Micro-batches packed by tokens (``micro_batch_tokens``, verl's dynamic batch size): the cut is the fewest runs
within the budget, then exactly as many as asked; a run of rows that cuts prompts' groups gives each row the
log-probs and gradients it has in the whole batch. (The trainer's gradient under several budgets, on one and
on two processes: tests/test_distributed.py.)"""

import itertools
import random
from itertools import pairwise

import pytest
import torch

from emapg.models.forward import response_logprobs
from emapg.models.zoo import load_model
from emapg.rollout.hf import generate
from emapg.rollout.sampling import RolloutBatch, SamplingSpec
from emapg.run.trainer import cut_into, greedy_cuts, row_tokens, step_micro_batches
from emapg.tasks import make_task


def _fewest(tokens: list[int], budget: int) -> int:
    """The fewest consecutive runs within budget (a longer row alone), by trying every set of boundaries."""
    n = len(tokens)
    for parts in range(1, n + 1):
        for inner in itertools.combinations(range(1, n), parts - 1):
            cuts = [0, *inner, n]
            if all(b - a == 1 or sum(tokens[a:b]) <= budget for a, b in pairwise(cuts)):
                return parts
    raise AssertionError


def test_the_cut_is_the_fewest_runs_within_budget_then_exactly_as_many_as_asked():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randint(1, 40) for _ in range(rng.randint(1, 8))]
        budget = rng.randint(1, 80)
        cuts = greedy_cuts(tokens, budget)
        assert len(cuts) - 1 == _fewest(tokens, budget)
        for parts in range(len(cuts) - 1, len(tokens) + 1):
            got = cut_into(tokens, parts, budget)
            runs = list(pairwise(got))
            assert got[0] == 0 and got[-1] == len(tokens) and len(runs) == parts
            assert all(b > a and (b - a == 1 or sum(tokens[a:b]) <= budget) for a, b in runs)
    with pytest.raises(ValueError, match="the greedy cut needs 3"):
        cut_into([10, 10, 10], 2, 10)


def _batch(seed: int = 1) -> tuple[torch.nn.Module, RolloutBatch]:
    model, tok = load_model("tiny-llama", seed=seed)
    examples = make_task("arithmetic", digits=2, terms=3, ops="+-").train_examples(random.Random(0), 3)
    examples[1].messages[0]["content"] += " Think about it."  # prompts of different lengths
    torch.manual_seed(0)
    return model, generate(model, tok, examples, SamplingSpec(n=3, temperature=0.9, max_new_tokens=12, k=4))


@pytest.mark.parametrize("sharing", [True, False])
def test_runs_of_rows_that_cut_groups_give_each_row_its_log_probs_and_gradients(sharing):
    """Rows 2-6 of 3 prompts x 3 samples (the last of prompt 0, all of prompt 1, the first of prompt 2) and the
    other rows, each run passed on its own: the log-probs equal the whole batch's, and so do the summed gradients."""
    model, batch = _batch()
    assert batch.prompt_mask.sum(1).unique().numel() > 1 and batch.response_mask.sum(1).unique().numel() > 1

    def pass_(mb):
        st = response_logprobs(model, mb, temperature=0.9, ids=mb.samp_topk[mb.response_mask.bool()],
                               prefix_sharing=sharing)
        (st.logp_tok.sum() + st.logp_ids.exp().sum()).backward()
        return st.logp_tok.detach()

    model.zero_grad()
    whole = pass_(batch)
    g_whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    runs = [batch.row_batch(slice(a, b)) for a, b in [(0, 2), (2, 7), (7, 9)]]
    assert runs[1].prompt_ids.shape[0] == 3 and runs[1].row_prompt.tolist() == [0, 1, 1, 1, 2]
    parts = torch.cat([pass_(mb) for mb in runs])
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    for name, g in g_whole.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, atol=1e-5, rtol=1e-4)


def test_a_step_is_packed_by_its_rows_tokens():
    """Each mini-batch is cut on its own, rows in order; row_tokens counts a row's prompt and its response up to
    the last token that counts."""
    _, batch = _batch()
    tokens = row_tokens(batch)
    prompt = batch.prompt_mask.sum(1).repeat_interleave(3)
    last = torch.tensor([int(m.nonzero().max()) + 1 if m.any() else 0 for m in batch.response_mask])
    assert tokens == (prompt + last).tolist()
    budget = max(tokens) + 1  # at most a row or two each
    minis = step_micro_batches(batch, mini_prompts=1, micro_prompts=1, micro_tokens=budget)
    assert len(minis) == 3
    for p, mbs in enumerate(minis):
        rows = [r for mb in mbs for r in range(mb.response_ids.shape[0])]
        assert len(rows) == 3  # a mini-batch keeps its own rows
        assert all(sum(tokens[3 * p + i] for i in range(len(mb.completions))) <= budget or len(mb.completions) == 1
                   for mb in mbs)
    whole = step_micro_batches(batch, mini_prompts=3, micro_prompts=1, micro_tokens=10**6)
    assert len(whole) == 1 and len(whole[0]) == 1 and whole[0][0].completions == batch.completions
    by_prompts = step_micro_batches(batch, mini_prompts=3, micro_prompts=1)
    assert [len(m) for m in by_prompts] == [3] and by_prompts[0][1].row_prompt is None
