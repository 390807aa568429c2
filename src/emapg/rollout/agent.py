"""Multi-turn tool rollouts (the Search-R1 protocol, docs/METHOD.md section 6).

The model writes ``<search> query </search>``; the environment retrieves passages and appends
``<information> ... </information>``; the episode ends at ``<answer> ... </answer>``, at an
end-of-sequence token, or when a budget runs out. All live samples advance together, one turn
per batched generation; finished ones drop out.

The response of a sample is everything after its prompt: model turns and retrieved information,
interleaved. ``response_mask`` is 1 only on tokens the model generated, so the information is
context for later turns but takes no part in the policy-gradient or KL terms; sampled log-probs,
entropies and top-k ids are recorded only for model tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from emapg.models.lm import first_tokens_text
from emapg.rollout.hf import HFSampler
from emapg.rollout.sampling import RolloutBatch, Sampled, SamplingSpec, concat, eos_ids, format_prompt, pad_left
from emapg.tags import SEARCH_RE, STOPS, answers_in, format_information
from emapg.tasks.base import AgentConfig, Example

# A sampler continues B contexts (token lists) by at most ``max_new_tokens`` tokens, stopping each row
# at a stop string or EOS (later positions are padding), and records the per-token statistics
# (top_p_cut may be None: the batch then has none). HFSampler (which keeps each episode's key/value
# cache from one turn to the next) or VLLMRollout.sampler.
Sampler = Callable[[list[list[int]], int], Sampled]


@dataclass
class _Episode:
    prompt: list[int]
    tokens: list[int]
    mask: list[int]
    logp: list[float]
    entropy: list[float]
    cut: list[float]  # mass top-p cut at each token
    topk: list[list[int]]
    lead: str = ""  # text the prompt or the environment put at the start of the model's next turn
    searches: int = 0
    support: list[str] = field(default_factory=list)  # titles of the passages that answer the question
    found: set[str] = field(default_factory=set)  # titles of the passages retrieved so far
    turns: int = 0
    done: bool = False
    truncated: bool = False


def _cut(tokenizer, ids: list[int], eos: set[int]) -> tuple[int, str]:
    """Length of a turn: up to and including the first EOS, or the token completing a stop string."""
    text = ""
    for i, tok in enumerate(ids):
        if tok in eos:
            return i + 1, "eos"
        text += tokenizer.decode([tok], skip_special_tokens=True)
        if any(s in text for s in STOPS):
            return i + 1, "stop"
    return len(ids), "budget"


def agent_rollout(sampler: Sampler, tokenizer, examples: list[Example], retriever, spec: SamplingSpec, *,
                  config: AgentConfig | None = None, eos: list[int] | None = None) -> RolloutBatch:
    """``spec.n`` episodes per example (``spec.k``: top-k ids recorded per model token; the sampler
    samples as ``spec`` says). ``retriever.search(queries, topk)`` answers the searches.

    Returns a RolloutBatch (rewards not set) whose ``stats`` hold, per response, ``searches`` and
    ``turns``, and ``info_tokens`` (tokens of retrieved information in the response).
    """
    cfg = config or AgentConfig()
    eos_set = set(eos if eos is not None else [tokenizer.eos_token_id])
    prompts = [format_prompt(tokenizer, ex.messages) for ex in examples]
    leads = [ex.messages[-1]["content"] if ex.messages[-1]["role"] == "response_prefix" else "" for ex in examples]
    eps = [_Episode(prompt=p, tokens=[], mask=[], logp=[], entropy=[], cut=[], topk=[], lead=lead,
                    support=ex.meta.get("support", []))
           for p, lead, ex in zip(prompts, leads, examples, strict=True) for _ in range(spec.n)]
    has_cut = True  # False once a sampler gives no top_p_cut (vLLM): the batch then has none
    while live := [e for e in eps if not e.done]:
        budget = [min(cfg.max_turn_tokens, cfg.max_total_tokens - len(e.tokens)) for e in live]
        out = sampler([e.prompt + e.tokens for e in live], max(budget))
        has_cut = has_cut and out.top_p_cut is not None
        turns = [_model_turn(e, out, row, budget[row], tokenizer, eos_set, has_cut, cfg)
                 for row, e in enumerate(live)]
        queries = [(e, q) for e, q in zip(live, turns, strict=True) if q is not None and q is not INVALID]
        if queries:
            results = retriever.search([q for _, q in queries], cfg.passages)
            for (e, _), passages in zip(queries, results, strict=True):
                _add_information(e, passages, tokenizer, cfg, spec.k)
        for e, q in zip(live, turns, strict=True):
            if q is INVALID:  # cut as an observation is (Search-R1's max_obs_length)
                text = tokenizer.encode(cfg.invalid_action, add_special_tokens=False)
                _add_context(e, text[: min(cfg.max_info_tokens, cfg.max_total_tokens - len(e.tokens))], cfg, spec.k)
    return _to_batch(tokenizer, prompts, eps, spec.n, spec.k, has_cut)


INVALID = "<invalid action>"  # what _model_turn returns for a turn that neither searches nor answers, and goes on


def _model_turn(e: _Episode, out: Sampled, row: int, budget: int, tokenizer, eos: set[int], has_cut: bool,
                cfg: AgentConfig) -> str | None:
    """Append row ``row`` of the sampler's output to episode ``e`` as a model turn (up to its end);
    returns the turn's search query, :data:`INVALID` for a turn with neither a search nor an answer that
    the episode survives (``cfg.invalid_action``), or None when the episode ended (an answer, the last turn,
    EOS or the budget without an action, the episode's token budget)."""
    # a row's own length when the sampler reports it: with pad = EOS, padding is not an EOS
    end = budget if out.length is None else min(budget, int(out.length[row]))
    new = out.ids[row].tolist()[:end]
    length, why = _cut(tokenizer, new, eos)
    e.tokens += new[:length]
    e.mask += [1] * length
    e.logp += out.logp[row, :length].tolist()
    e.entropy += out.entropy[row, :length].tolist()
    e.cut += out.top_p_cut[row, :length].tolist() if has_cut else [0.0] * length
    e.topk += out.topk[row, :length].tolist() if out.topk is not None else [[]] * length
    e.turns += 1
    text = e.lead + tokenizer.decode(new[:length], skip_special_tokens=True)
    e.lead = ""
    searching = why == "stop" and SEARCH_RE.findall(text)
    if why == "stop" and answers_in(text):
        e.done = True
    elif searching and e.turns <= cfg.max_turns:  # (with every earlier turn a search: e.searches < max_turns)
        return searching[-1].strip()
    elif (cfg.invalid_action and not searching and e.turns <= cfg.max_turns
          and len(e.tokens) < cfg.max_total_tokens):  # neither a search nor an answer: Search-R1 says so, goes on
        if why == "eos":
            _drop_last(e)
        return INVALID
    else:  # EOS without an answer, a search past max_turns, or the budget ran out
        e.done = True
        e.truncated = why == "budget"
    return None


def _drop_last(e: _Episode) -> None:
    """Remove the episode's last token (an EOS the episode goes on after) and its records."""
    for field_ in (e.tokens, e.mask, e.logp, e.entropy, e.cut, e.topk):
        field_.pop()


def _add_information(e: _Episode, passages, tokenizer, cfg: AgentConfig, k: int) -> None:
    """Append the retrieved passages (and the text opening the next turn) to episode ``e``: context,
    mask 0, zero statistics."""
    room = max(0, min(cfg.max_info_tokens, cfg.max_total_tokens - len(e.tokens)))
    text = first_tokens_text(format_information(passages), room, tokenizer)  # 50 MB took 38 s and died
    info = tokenizer(text, add_special_tokens=False).input_ids[:room]
    e.searches += 1
    e.found.update(p.title for p in passages)
    e.lead = ""
    if cfg.force_answer and e.searches == cfg.max_turns:
        e.lead = "<answer>"
    elif cfg.turn_prefix and e.searches < cfg.max_turns:
        e.lead = cfg.turn_prefix
    if e.lead:
        info += tokenizer(e.lead, add_special_tokens=False).input_ids
    _add_context(e, info, cfg, k)


def _add_context(e: _Episode, ids: list[int], cfg: AgentConfig, k: int) -> None:
    """Append environment tokens to episode ``e`` (mask 0, zero statistics); the episode's token budget spent
    ends it."""
    e.tokens += ids
    e.mask += [0] * len(ids)
    e.logp += [0.0] * len(ids)
    e.entropy += [0.0] * len(ids)
    e.cut += [0.0] * len(ids)
    e.topk += [[0] * k if k else []] * len(ids)
    if len(e.tokens) >= cfg.max_total_tokens:
        e.done, e.truncated = True, True


def _to_batch(tokenizer, prompts: list[list[int]], eps: list[_Episode], n: int, k: int,
              has_cut: bool) -> RolloutBatch:
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = pad_left(prompts, pad)
    width = max(1, max(len(e.tokens) for e in eps))
    b = len(eps)

    def right(rows: list[list], fill, dtype) -> Tensor:
        t = torch.full((b, width), fill, dtype=dtype)
        for i, r in enumerate(rows):
            if r:
                t[i, : len(r)] = torch.tensor(r, dtype=dtype)
        return t

    topk = None
    if k:
        topk = torch.zeros((b, width, k), dtype=torch.long)
        for i, e in enumerate(eps):
            if e.topk:
                topk[i, : len(e.topk)] = torch.tensor(e.topk, dtype=torch.long)
    ids = right([e.tokens for e in eps], pad, torch.long)
    completions = [tokenizer.decode(e.tokens, skip_special_tokens=True) for e in eps]
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids,
        response_mask=right([e.mask for e in eps], 0, torch.long),
        samp_logp=right([e.logp for e in eps], 0.0, torch.float32), n=n, samp_topk=topk,
        top_p_cut=right([e.cut for e in eps], 0.0, torch.float32) if has_cut else None,
        entropy=right([e.entropy for e in eps], 0.0, torch.float32),
        truncated=torch.tensor([e.truncated for e in eps]), completions=completions,
        stats={"searches": torch.tensor([float(e.searches) for e in eps]),
               "turns": torch.tensor([float(e.turns) for e in eps]),
               "info_tokens": torch.tensor([float(len(e.mask) - sum(e.mask)) for e in eps]),
               **_support_stats(eps)},
    )


def _support_stats(eps: list[_Episode]) -> dict[str, Tensor]:
    """With support titles on every example (the synthetic knowledge base): the share of an episode's
    support passages it retrieved, and whether it retrieved the last one (a two-hop question's bridge)."""
    if not eps or not all(e.support for e in eps):
        return {}
    return {"support_recall": torch.tensor([sum(t in e.found for t in e.support) / len(e.support) for e in eps]),
            "bridge_hit": torch.tensor([float(e.support[-1] in e.found) for e in eps])}


def rollout_model(model: nn.Module, tokenizer, examples: list[Example], retriever, spec: SamplingSpec, *,
                  config: AgentConfig | None = None, prefix_sharing: bool = True,
                  reuse_cache: bool = True, max_rows: int | None = None) -> RolloutBatch:
    """:func:`agent_rollout` with a Hugging Face model as the policy; tensors on the model's device.
    reuse_cache: each turn feeds only its new tokens on top of the episode's key/value cache
    (False: every turn re-reads the whole context, the reference path). max_rows: episodes of at most
    this many rows (whole prompts' n, at least one prompt) run together, one group after the other."""
    per = len(examples) if max_rows is None else max(1, max_rows // spec.n)
    eos, parts = eos_ids(model, tokenizer), []
    for start in range(0, len(examples), per):
        sampler = HFSampler(model, tokenizer, spec, stop_strings=STOPS, reuse_cache=reuse_cache,
                            prefix_sharing=prefix_sharing)
        parts.append(agent_rollout(sampler, tokenizer, examples[start : start + per], retriever, spec, config=config,
                                   eos=eos))
        del sampler  # its cache goes before the next group's
    return (parts[0] if len(parts) == 1 else concat(parts)).to(next(model.parameters()).device)
