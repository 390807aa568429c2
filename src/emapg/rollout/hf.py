"""Rollouts with Hugging Face ``generate``: batched, left-padded, n samples per prompt.

From the generation scores (the logits after temperature and top-p, which are exactly the
sampling distribution) it records, per generated token, the sampled token's log-prob and that
distribution's top-k ids, with no extra forward pass (spec section 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import StoppingCriteria, StoppingCriteriaList

from emapg.rollout.batch import RolloutBatch, response_mask_from_ids
from emapg.tasks.base import Example


def format_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt: the tokenizer's chat template when it has one, else plain text.
    A single message with role ``raw`` is sent as it is (base models). A last message with role
    ``response_prefix`` starts the assistant's turn with its text (part of the prompt, not generated)."""
    prefix = ""
    if messages and messages[-1]["role"] == "response_prefix":
        prefix, messages = messages[-1]["content"], messages[:-1]
    return tokenizer(_prompt_text(tokenizer, messages) + prefix, add_special_tokens=False).input_ids


def _prompt_text(tokenizer, messages: list[dict[str, str]]) -> str:
    if len(messages) == 1 and messages[0]["role"] == "raw":
        text = messages[0]["content"]
    elif getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return text


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists to [P, Lp] ids and mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
    return ids, mask


def eos_ids(model: nn.Module, tokenizer) -> list[int]:
    """End-of-sequence ids: the tokenizer's and the model's generation config's."""
    ids = {tokenizer.eos_token_id}
    cfg = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(cfg if isinstance(cfg, list) else [cfg])
    return sorted(i for i in ids if i is not None)


def _shared_prefix_inputs(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, n: int) -> dict:
    """generate() inputs for P*n rows whose cache of the first Lp-1 prompt tokens was computed once per
    prompt. generate() then feeds only the last prompt token and continues decoding."""
    head_ids, head_mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
    pos = (head_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=head_ids, attention_mask=head_mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or out.past_key_values
    cache.batch_repeat_interleave(n)
    from emapg.forward import cache_kwarg, decoder_and_head

    return {"input_ids": prompt_ids.repeat_interleave(n, 0), "attention_mask": prompt_mask.repeat_interleave(n, 0),
            cache_kwarg(decoder_and_head(model)[0]): cache, "num_return_sequences": 1}


@dataclass
class Sampled:
    """What a sampler returns for B rows: new tokens [B, T] (padded after each row's end) and, per
    token, the sampling distribution's log-prob of it, entropy, tail mass outside top-p, top-k ids."""

    ids: Tensor
    logp: Tensor
    entropy: Tensor
    tail_lost: Tensor
    topk: Tensor | None


class StopOnStrings(StoppingCriteria):
    """Per-row stop once the generated text (not the prompt) contains one of ``stops``."""

    def __init__(self, tokenizer, stops: list[str], prompt_len: int):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, stops, prompt_len
        self.window = max(len(s) for s in stops) + 1  # every token covers at least one character

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        tails = self.tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stops) for t in tails], device=input_ids.device)


def _sampling_kwargs(greedy: bool, temperature: float, top_p: float) -> dict:
    sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if not greedy:
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    # Neutralise any other logits processor a model's generation_config may ship (repetition penalty,
    # min_p, suppressed tokens...): the recorded log-probs must be those of pi_theta at the temperature.
    sampling.update(repetition_penalty=1.0, no_repeat_ngram_size=0, min_p=None, typical_p=1.0, min_length=0,
                    min_new_tokens=None, suppress_tokens=None, begin_suppress_tokens=None, bad_words_ids=None)
    return sampling


@torch.no_grad()
def sample(
    model: nn.Module,
    tokenizer,
    inputs: dict,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    k: int = 0,
    greedy: bool = False,
    stop_strings: list[str] | None = None,
) -> Sampled:
    """``model.generate`` on prepared inputs (input_ids, attention_mask, ...), recording from the
    scores, per new token, its log-prob under the sampling distribution, the entropy, the tail mass
    lost to top-p and the top-k ids; no extra forward pass."""
    prompt_len = inputs["input_ids"].shape[1]
    extra = {}
    if stop_strings:
        extra["stopping_criteria"] = StoppingCriteriaList([StopOnStrings(tokenizer, stop_strings, prompt_len)])
    was_training = model.training
    model.eval()
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, eos_token_id=eos_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True,
        output_logits=top_p < 1.0 and not greedy, **_sampling_kwargs(greedy, temperature, top_p), **extra,
    )
    model.train(was_training)
    resp = out.sequences[:, prompt_len:]
    device = resp.device
    samp_logp = torch.zeros(resp.shape, dtype=torch.float32, device=device)
    tail_lost = torch.zeros(resp.shape, dtype=torch.float32, device=device)
    entropy = torch.zeros(resp.shape, dtype=torch.float32, device=device)
    topk = torch.zeros((*resp.shape, k), dtype=torch.long, device=device) if k > 0 else None
    for t, scores in enumerate(out.scores):
        scores = scores.float() if not greedy else scores.float() / temperature
        logp = torch.log_softmax(scores, -1)
        samp_logp[:, t] = logp.gather(-1, resp[:, t : t + 1]).squeeze(-1)
        entropy[:, t] = -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)
        if out.logits is not None:
            # mass outside the nucleus, under the tempered but untruncated distribution
            full = torch.softmax(out.logits[t].float() / temperature, -1)
            tail_lost[:, t] = (full * torch.isinf(scores)).sum(-1)
        if topk is not None:
            topk[:, t] = logp.topk(min(k, logp.shape[-1]), -1).indices
    return Sampled(ids=resp, logp=samp_logp, entropy=entropy, tail_lost=tail_lost, topk=topk)


def generate(
    model: nn.Module,
    tokenizer,
    examples: list[Example],
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 32,
    k: int = 0,
    greedy: bool = False,
    prefix_sharing: bool = True,
) -> RolloutBatch:
    """Sample ``n`` responses per example; returns a :class:`RolloutBatch` (rewards not yet set).

    k: how many top-k ids of the sampling distribution to record per token (0 = none).
    greedy: argmax decoding (evaluation); then samp_logp is the tempered log-prob of the argmax.
    prefix_sharing: run each prompt once (all but its last token) and hand ``generate`` the key/value
        cache repeated n times, instead of letting it run every prompt n times.
    """
    if greedy and n > 1:
        raise ValueError("greedy decoding gives one response per prompt: use n = 1 or sampling")
    device = next(model.parameters()).device
    prompts = [format_prompt(tokenizer, ex.messages) for ex in examples]
    prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    inputs = dict(input_ids=prompt_ids, attention_mask=prompt_mask, num_return_sequences=n)
    if prefix_sharing and n > 1 and prompt_ids.shape[1] > 1:
        with torch.no_grad():
            inputs = _shared_prefix_inputs(model, prompt_ids, prompt_mask, n)
    out = sample(model, tokenizer, inputs, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                 k=k, greedy=greedy)
    resp = out.ids
    mask, truncated = response_mask_from_ids(resp, eos_ids(model, tokenizer))
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=resp, response_mask=mask, samp_logp=out.logp,
        n=n, samp_topk=out.topk, tail_lost=out.tail_lost, entropy=out.entropy, truncated=truncated,
        completions=tokenizer.batch_decode(resp.masked_fill(mask == 0, tokenizer.pad_token_id),
                                           skip_special_tokens=True),
    )
