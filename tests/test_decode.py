"""Our decode loop: the same tokens as Hugging Face ``generate``, per-token statistics equal to those
of generate's full scores, to the training pass and (under top-p) to the untruncated policy; and
multi-turn episodes that keep their cache equal to ones that re-read the whole context."""

import random
import re

import pytest
import torch

import emapg.rollout.hf as decode_mod
from emapg.models.forward import response_logprobs
from emapg.models.zoo import load_model
from emapg.retrieval import Passage
from emapg.rollout.agent import rollout_model
from emapg.rollout.hf import HFSampler, generate
from emapg.rollout.sampling import SamplingSpec, draw, eos_ids, format_prompt, pad_left
from emapg.tasks import make_task
from emapg.tasks.base import AgentConfig


def _examples(n=3):
    examples = make_task("arithmetic", digits=2, terms=3, ops="+-").train_examples(random.Random(0), n)
    examples[1].messages[0]["content"] += " Think about it."  # prompts of different lengths: left padding
    return examples


def _reference_generate(model, tok, examples, n, temperature, top_p, max_new_tokens, k, greedy):
    """What the HF backend did before our loop: ``generate`` with output_scores (and output_logits
    under top-p), every step's [rows, vocab] kept, statistics computed at the end."""
    prompts = [format_prompt(tok, ex.messages) for ex in examples]
    ids, mask = pad_left(prompts, tok.pad_token_id)
    sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None) if greedy else dict(
        do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    out = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=n, max_new_tokens=max_new_tokens,
                         eos_token_id=eos_ids(model, tok), pad_token_id=tok.pad_token_id, output_scores=True,
                         output_logits=True, return_dict_in_generate=True, **sampling)
    resp = out.sequences[:, ids.shape[1]:]
    logp, ent, tail, topk = [], [], [], []
    for t, scores in enumerate(out.scores):
        scores = scores.float() / temperature if greedy else scores.float()
        lp = torch.log_softmax(scores, -1)
        logp.append(lp.gather(-1, resp[:, t : t + 1]).squeeze(-1))
        ent.append(-(lp.exp() * lp.masked_fill(torch.isinf(lp), 0.0)).sum(-1))
        full = torch.softmax(out.logits[t].float() / temperature, -1)
        tail.append((full * torch.isinf(scores)).sum(-1))
        topk.append(lp.topk(k, -1).indices)
    return resp, torch.stack(logp, 1), torch.stack(ent, 1), torch.stack(tail, 1), torch.stack(topk, 1)


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("greedy,temperature,top_p", [(False, 1.0, 1.0), (False, 0.7, 0.9), (True, 0.6, 1.0)])
def test_decode_loop_draws_what_generate_draws_and_records_its_statistics(kind, greedy, temperature, top_p,
                                                                         monkeypatch):
    """With generate's own draw (torch.multinomial) the loop yields generate's tokens for the same seed."""
    model, tok = load_model(kind, seed=2)
    monkeypatch.setattr(decode_mod, "draw", lambda probs, u: torch.multinomial(probs, 1).squeeze(1))
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.zeros(a[0], dtype=torch.float64))  # no RNG use
    monkeypatch.setattr(decode_mod, "COMPACT_BELOW", 0.0)  # every row drawn at every step, as generate does
    examples, n = _examples(), 1 if greedy else 3
    torch.manual_seed(0)
    ref = _reference_generate(model, tok, examples, n, temperature, top_p, 12, 5, greedy)
    torch.manual_seed(0)
    ours = generate(model, tok, examples,
                    SamplingSpec(n=n, temperature=temperature, top_p=top_p, max_new_tokens=12, k=5, greedy=greedy),
                    prefix_sharing=False)
    assert torch.equal(ours.response_ids, ref[0])
    valid = ours.response_mask.bool()
    for got, want in ((ours.samp_logp, ref[1]), (ours.entropy, ref[2]), (ours.top_p_cut, ref[3])):
        torch.testing.assert_close(got[valid], want[valid], atol=1e-6, rtol=1e-6)
    assert torch.equal(ours.samp_topk[valid], ref[4][valid])
    if top_p < 1.0:
        assert float(ours.top_p_cut[valid].max()) > 0.01  # top-p did cut mass here


def test_finished_rows_leaving_the_batch_change_nothing(monkeypatch):
    model, tok = load_model("tiny-qwen2", seed=3)
    model.generation_config.eos_token_id = list(range(1, 40))  # rows end at many different steps
    out = []
    for compact in (0.0, 1.0):  # never / as soon as one row finishes
        monkeypatch.setattr(decode_mod, "COMPACT_BELOW", compact)
        torch.manual_seed(0)
        spec = SamplingSpec(n=3, temperature=1.3, top_p=0.95, max_new_tokens=40, k=3)
        out.append(generate(model, tok, _examples(4), spec))
    assert out[0].response_mask.sum(1).unique().numel() > 3  # rows did end at different steps
    for name in ("response_ids", "response_mask"):
        assert torch.equal(getattr(out[0], name), getattr(out[1], name))
    valid = out[0].response_mask.bool()  # what a finished row records after its end is not kept
    assert torch.equal(out[0].samp_topk[valid], out[1].samp_topk[valid])
    for name in ("samp_logp", "entropy", "top_p_cut"):
        torch.testing.assert_close(getattr(out[0], name)[valid], getattr(out[1], name)[valid], atol=1e-5, rtol=1e-5)


def test_recorded_statistics_equal_the_training_pass_and_the_untruncated_policy_under_top_p():
    model, tok = load_model("tiny-llama", seed=4)
    torch.manual_seed(1)
    batch = generate(model, tok, _examples(), SamplingSpec(n=4, temperature=0.8, top_p=0.85, max_new_tokens=10, k=6))
    valid = batch.response_mask.bool()
    st = response_logprobs(model, batch, temperature=0.8, k_self=6)
    # the nucleus renormalises: log pi_samp(y) = log pi(y) - log(1 - tail) for every sampled token
    tail = batch.top_p_cut[valid]
    assert float(tail.max()) > 0.01
    torch.testing.assert_close(batch.samp_logp[valid], st.logp_tok - torch.log1p(-tail), atol=1e-5, rtol=1e-5)
    # the nucleus keeps the most likely tokens, so the sampler's top-k are the policy's top-k where the
    # nucleus holds at least k tokens (-inf elsewhere make the remaining ids arbitrary)
    full = (batch.samp_topk[valid] == st.topk_ids).all(-1)
    assert full.float().mean() > 0.5
    torch.manual_seed(1)
    plain = generate(model, tok, _examples(), SamplingSpec(n=4, temperature=0.8, max_new_tokens=10, k=6))
    valid = plain.response_mask.bool()
    st = response_logprobs(model, plain, temperature=0.8, k_self=6)
    torch.testing.assert_close(plain.samp_logp[valid], st.logp_tok, atol=1e-5, rtol=1e-5)
    assert torch.equal(plain.samp_topk[valid], st.topk_ids)
    assert float(plain.top_p_cut.abs().max()) == 0.0


def test_a_row_that_stops_without_eos_is_not_ended_by_padding_when_pad_is_eos():
    model, tok = load_model("tiny-llama", seed=0)
    assert tok.pad_token_id in eos_ids(model, tok)
    torch.manual_seed(0)
    batch = generate(model, tok, _examples(2), SamplingSpec(n=2, max_new_tokens=6))
    for row in range(batch.response_ids.shape[0]):
        ids, mask = batch.response_ids[row], batch.response_mask[row]
        if batch.truncated[row]:
            assert int(mask.sum()) == 6 and not bool(torch.isin(ids, torch.tensor(eos_ids(model, tok))).any())
        else:  # ended by its own EOS, which counts
            assert int(ids[int(mask.sum()) - 1]) in eos_ids(model, tok)


class _Retriever:
    def search(self, queries, topk=1):
        return [[Passage(id=str(i), title=f"T{len(q)}", text=f"fact {i} about {q[:12]}", score=1.0)][:topk]
                for i, q in enumerate(queries)]


def _search_examples(tok):
    from emapg.tasks.base import Example

    qs = ["Who wrote the book?", "Where was Ann born, in which city?", "What is 2 + 2?"]
    return [Example(id=str(i), messages=[{"role": "raw", "content": f"Question: {q}\n"},
                                         {"role": "response_prefix", "content": "<search>"}], answer=["x"])
            for i, q in enumerate(qs)]


@pytest.mark.parametrize("greedy", [False, True])
def test_multi_turn_cache_equals_re_reading_the_context(greedy, monkeypatch):
    """Every turn after the first feeds only its new tokens, and the episodes (tokens, masks, recorded
    log-probs, entropies, top-k) equal those of the path that re-reads the whole context each turn."""
    model, tok = load_model("tiny-llama", seed=5)
    import emapg.rollout.agent as agent_mod

    # A random model never writes the tags: every printable character is a stop string and every
    # stopped turn a search, so episodes run several turns of different lengths.
    monkeypatch.setattr(agent_mod, "STOPS", [chr(c) for c in range(33, 127)])
    monkeypatch.setattr(agent_mod, "SEARCH_RE", re.compile(r"(.+)", re.S))
    cfg = AgentConfig(max_turns=3, passages=1, max_turn_tokens=8, max_total_tokens=90, max_info_tokens=20)
    fed: list[int] = []
    forward = model.forward

    def spy(*args, **kwargs):
        fed.append(int(kwargs["input_ids"].numel()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    runs = {}
    for reuse in (False, True):
        torch.manual_seed(0)
        fed.clear()
        spec = SamplingSpec(n=1 if greedy else 2, k=4, greedy=greedy)
        runs[reuse] = (rollout_model(model, tok, _search_examples(tok), _Retriever(), spec, config=cfg,
                                     reuse_cache=reuse), sum(fed))
    (plain, fed_plain), (cached, fed_cached) = runs[False], runs[True]
    assert float(plain.stats["searches"].mean()) >= 1.5  # episodes really ran several turns
    assert torch.equal(plain.response_ids, cached.response_ids)
    assert torch.equal(plain.response_mask, cached.response_mask)
    assert torch.equal(plain.samp_topk, cached.samp_topk)
    for name in ("samp_logp", "entropy"):
        torch.testing.assert_close(getattr(cached, name), getattr(plain, name), atol=1e-5, rtol=1e-5)
    assert fed_cached < 0.6 * fed_plain  # later turns fed only their new tokens


def test_agent_episodes_in_bounded_groups_equal_every_episode_at_once(monkeypatch):
    """rollout.max_rows for agent tasks: episodes run in groups of whole prompts and the groups' batches
    are joined (prompts re-padded on the left, responses on the right); greedy, so every row is the same
    computation either way."""
    model, tok = load_model("tiny-llama", seed=5)
    import emapg.rollout.agent as agent_mod

    monkeypatch.setattr(agent_mod, "STOPS", [chr(c) for c in range(33, 127)])
    monkeypatch.setattr(agent_mod, "SEARCH_RE", re.compile(r"(.+)", re.S))
    cfg = AgentConfig(max_turns=3, passages=1, max_turn_tokens=8, max_total_tokens=90, max_info_tokens=20)
    spec = SamplingSpec(n=1, k=4, greedy=True)
    examples = _search_examples(tok)
    assert len(examples) >= 3
    whole = rollout_model(model, tok, examples, _Retriever(), spec, config=cfg)
    for bound in (1, 2):
        part = rollout_model(model, tok, examples, _Retriever(), spec, config=cfg, max_rows=bound)
        assert torch.equal(part.prompt_ids * part.prompt_mask, whole.prompt_ids * whole.prompt_mask)
        assert torch.equal(part.prompt_mask, whole.prompt_mask)
        width = whole.response_ids.shape[1]
        assert torch.equal(part.response_mask[:, :width], whole.response_mask)
        assert int(part.response_mask[:, width:].sum()) == 0
        ids = (part.response_ids * part.response_mask)[:, :width]
        assert torch.equal(ids, whole.response_ids * whole.response_mask)
        torch.testing.assert_close(part.samp_logp[:, :width] * whole.response_mask,
                                   whole.samp_logp * whole.response_mask, atol=1e-5, rtol=1e-5)
        assert part.completions == whole.completions
        assert torch.equal(part.stats["searches"], whole.stats["searches"])


def test_sampler_feeds_only_new_tokens_and_drops_rows_that_are_not_continued():
    model, tok = load_model("tiny-llama", seed=6)
    sampler = HFSampler(model, tok, SamplingSpec(k=3, greedy=True))
    ctx = [tok("Alpha beta", add_special_tokens=False).input_ids, tok("Gamma", add_special_tokens=False).input_ids,
           tok("Delta epsilon zeta", add_special_tokens=False).input_ids]
    first = sampler(ctx, 5)
    rows = [c + first.ids[i, : int(first.length[i])].tolist() + [7, 8, 9] for i, c in enumerate(ctx)]
    second = sampler([rows[0], rows[2]], 4)  # row 1 finished: dropped from the cache
    assert sampler.state.mask.shape[0] == 2
    fresh = HFSampler(model, tok, SamplingSpec(k=3, greedy=True))([rows[0], rows[2]], 4)
    assert torch.equal(second.ids, fresh.ids) and torch.equal(second.topk, fresh.topk)
    torch.testing.assert_close(second.logp, fresh.logp, atol=1e-5, rtol=1e-5)
    # a call that does not continue the held rows starts afresh
    other = sampler([ctx[1]], 3)
    alone = HFSampler(model, tok, SamplingSpec(k=3, greedy=True))([ctx[1]], 3)
    assert torch.equal(other.ids, alone.ids)


def test_draw_inverts_the_cdf_exactly_and_never_draws_a_token_without_mass():
    """Enumerate the uniform on a fine grid: each token is drawn for exactly its share of the grid."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.125, 0.5, 0.125, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    grid = 4096
    counts = torch.zeros_like(probs, dtype=torch.float64)
    for i in range(grid):
        counts[torch.arange(2), draw(probs, torch.full((2, 1), i / grid, dtype=torch.float64))] += 1
    torch.testing.assert_close(counts / grid, probs.double(), atol=0.0, rtol=0.0)
    # the largest uniform below 1, and a total mass a little under 1: still a token with mass
    last = torch.full((2, 1), 1 - 2**-53, dtype=torch.float64)
    assert draw(probs * (1 - 1e-7), last).tolist() == [5, 3]


def test_draw_gives_each_token_exactly_its_share_of_a_uniform_grid():
    """Rows as decoding makes them (float32 softmax, not dyadic, tokens without mass): on the grid
    u = (j + 1/2) / G each token is drawn for exactly the grid points inside its CDF interval, which
    are counted here in exact rational arithmetic. No tolerance: every count must match, so a bias
    of one grid step (1/G = 3e-5 of probability) fails, where a Monte-Carlo frequency test at 200k
    draws resolves only about 1e-3."""
    from fractions import Fraction
    from itertools import accumulate, pairwise
    from math import ceil

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 2
    logits[:, ::7] = float("-inf")  # tokens without mass
    probs = torch.softmax(logits, -1)
    grid = 2**15
    u = ((torch.arange(grid, dtype=torch.float64) + 0.5) / grid)[:, None]
    for row in probs:
        counts = torch.bincount(draw(row.expand(grid, -1), u), minlength=row.numel()).tolist()
        mass = [Fraction(float(p)) for p in row]  # exactly the float32 values
        total = sum(mass)
        # grid points j with cdf[i - 1] <= u_j * total < cdf[i]: j from ceil(cdf[i - 1] / total * G - 1/2) on
        first = [ceil(c / total * grid - Fraction(1, 2)) for c in [Fraction(0), *accumulate(mass)]]
        assert counts == [b - a for a, b in pairwise(first)]
        assert all(counts[i] == 0 for i in range(0, row.numel(), 7))
    # the CDF is float64: a token whose mass is below float32's resolution of the running sum (here
    # 2**-40 after half the mass) still owns its interval
    tiny = torch.tensor([[0.5, 2.0**-40, 0.5]])
    assert draw(tiny, torch.tensor([[0.5 + 2.0**-42]], dtype=torch.float64)).tolist() == [1]


@pytest.mark.parametrize("sharing", [True, False])
def test_the_prefix_sharing_field_reaches_generation(sharing, tmp_path, monkeypatch):
    from pathlib import Path

    import emapg.rollout.hf as hf_mod
    from emapg.config import load_config
    from emapg.run.trainer import Trainer

    calls = []
    real = hf_mod.prefill
    monkeypatch.setattr(hf_mod, "prefill", lambda *a, **kw: calls.append(kw.get("repeat")) or real(*a, **kw))
    smoke = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"
    tr = Trainer(load_config(smoke, ["export=false", "eval.size=0", f"prefix_sharing={str(sharing).lower()}"]),
                 tmp_path, progress=False)
    tr.rollout(1)
    assert calls == ([tr.run.cfg.rollout.n] if sharing else [])


class _HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the device-to-host reads emapg's own rollout code makes (a tensor's truth value, item, tolist,
    int, float): on a GPU each one stalls the host until the device has caught up."""

    READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.ours = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            import traceback

            caller = traceback.extract_stack(limit=2)[0].filename  # the frame that asked
            self.ours += "/emapg/rollout/" in caller
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tokens", [16, 64])
def test_the_decode_loop_reads_the_device_once_per_token(tokens):
    """One host sync per generated token (whether to stop, whether to compact), a few per call: a sync that
    creeps into the loop fails here (transformers' own mask check is not counted)."""
    model, tok = load_model("tiny-llama", "float32")
    examples = make_task("arithmetic", digits=1).eval_examples(4)
    torch.manual_seed(0)
    with _HostSyncs() as counter:
        out = generate(model, tok, examples, SamplingSpec(n=2, max_new_tokens=tokens, k=4))
    steps = out.response_ids.shape[1]
    assert steps == tokens  # the random model never says EOS: every step runs
    assert counter.ours <= steps + 8, (counter.ours, steps)


def test_stop_strings_found_by_decoding_only_rows_that_drew_a_possible_last_token(monkeypatch):
    """Rows are decoded only when their newest token holds a stop string's last character; the rows and
    tokens equal those of decoding every row at every step (the stop strings are chosen so that a random
    byte-level model hits them often)."""
    model, tok = load_model("tiny-llama", seed=6)
    stops = [*"abcdefgh", "e ", "xyz"]
    enders = decode_mod.stop_enders(tok, stops, "cpu")
    assert 0 < len(enders) < len(tok) and all(any(c in tok.decode([int(i)]) for c in "abcdefgh z") for i in enders)
    prompts = [format_prompt(tok, ex.messages) for ex in _examples()]
    ids, mask = pad_left([p for p in prompts for _ in range(3)], tok.pad_token_id)
    spec = SamplingSpec(n=1, temperature=1.0, k=2)
    outs = []
    for every_token in (False, True):
        if every_token:
            monkeypatch.setattr(decode_mod, "stop_enders", lambda tok, stops, device: torch.arange(len(tok)))
        torch.manual_seed(0)
        outs.append(decode_mod.decode(model, ids, mask, None, spec, max_new_tokens=24, eos=[], pad_id=tok.pad_token_id,
                                      tokenizer=tok, stop_strings=stops, keep_state=False)[0])
    fast, full = outs
    assert int(full.length.min()) < 24  # stop strings ended some rows
    assert torch.equal(fast.length, full.length) and torch.equal(fast.ids, full.ids)
