"""The sampler contract both rollout backends share (HF decode loop, vLLM): prompt formatting,
padding, end-of-sequence ids, what a sampler returns, and the per-token statistics of a sampling
distribution (docs/METHOD.md section 5).

Every sampler records, per generated token and as it is produced: the sampled token's log-prob
under the sampling distribution (after temperature and top-p), that distribution's entropy, the
probability mass top-p removed from the tempered distribution, and its top-k ids. Only O(rows x k)
per token is kept, never ``[rows, vocab]`` beyond the current step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn


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


@dataclass(frozen=True)
class SamplingSpec:
    """How responses are drawn and what each token records, built once per run and passed whole to
    every backend (HF decode loop, vLLM, agent episodes) and to evaluation:
    :func:`emapg.algo.rollout_sampling` for training rollouts, :func:`emapg.run.evaluate.eval_sampling`
    for held-out evaluation.

    n: responses per prompt. temperature, top_p: the sampling distribution pi_samp (top_p = 1: no
    nucleus cut). max_new_tokens: a single-turn response's budget (an agent episode's budgets are its
    task's). greedy: argmax decoding (then n = 1; the recorded log-probs are the tempered
    distribution's). k: how many top-k ids of pi_samp to record per token (the top-k reverse KL's head;
    0 = none)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    greedy: bool = False
    k: int = 0

    def __post_init__(self):
        if self.greedy and self.n > 1:
            raise ValueError("greedy decoding gives one response per prompt: use n = 1 or sampling")


@dataclass
class Sampled:
    """What a sampler returns for B rows: new tokens [B, T] (padded after each row's end) and, per
    token, the sampling distribution's log-prob of it, entropy, tail mass outside top-p (None when
    the backend does not measure it), top-k ids [B, T, k] (or None).

    length: [B] tokens each row generated (its end-of-sequence or stop string included), or None:
    then a row ends at its first end-of-sequence token.
    """

    ids: Tensor
    logp: Tensor
    entropy: Tensor
    top_p_cut: Tensor | None
    topk: Tensor | None
    length: Tensor | None = None


def warp(logits: Tensor, temperature: float, top_p: float) -> tuple[Tensor, Tensor | None]:
    """The sampling distribution's scores from raw logits [B, V] (fp32): divided by the temperature,
    then, under top-p, every token outside the nucleus set to -inf (as Hugging Face's
    ``TopPLogitsWarper``: the smallest set of most likely tokens whose mass reaches top_p, at least
    one). Returns (scores [B, V], tail [B] mass outside the nucleus under the tempered distribution,
    or None when top_p = 1)."""
    scores = logits / temperature if temperature != 1.0 else logits
    if top_p >= 1.0:
        return scores, None
    sorted_scores, order = torch.sort(scores, descending=False)
    drop_sorted = sorted_scores.softmax(-1).cumsum(-1) <= (1 - top_p)
    drop_sorted[:, -1:] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    tail = (torch.softmax(scores, -1) * drop).sum(-1)
    return scores.masked_fill(drop, -float("inf")), tail


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """One token per row of ``probs`` [B, V] (rows summing to 1 up to rounding), drawn exactly from that
    categorical distribution by inverting its CDF (float64) at the row's uniform number ``u`` [B, 1]
    (float64, in [0, 1)).

    ``torch.multinomial`` draws V exponential numbers per row instead: on this project's CPU, 46 ms of
    a 200 ms decoding step at V = 49,152 (``bench/generation.py``). A token of probability 0 is never
    drawn: the uniform stays strictly below the total mass, and the first CDF entry above it belongs
    to a token with mass."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


@dataclass
class StepStats:
    """Per-row statistics of one decoding step's distribution at the chosen tokens: [B] / [B, k]."""

    logp: Tensor
    entropy: Tensor
    topk: Tensor | None


def step_stats(scores: Tensor, tokens: Tensor, k: int) -> StepStats:
    """Log-prob of ``tokens`` [B], entropy and top-k ids of the distribution ``softmax(scores)``
    (scores [B, V], -inf outside the support)."""
    logp = torch.log_softmax(scores, -1)
    entropy = -(logp.exp() * logp).nansum(-1)  # 0 * -inf = nan outside the support: dropped
    topk = logp.topk(min(k, logp.shape[-1]), -1).indices if k > 0 else None
    return StepStats(logp=logp.gather(-1, tokens[:, None]).squeeze(-1), entropy=entropy, topk=topk)


def stream_seed(*parts: int | str) -> int:
    """A 56-bit seed for one random stream, from the tuple that names it (run seed, step, rank,
    prompt, turn...): distinct tuples give unrelated seeds (a hash), where sums of their parts collide
    (seed + prompt * n + sample at one step is another step's seed). vLLM seeds a request's j-th
    sample with seed + j, far below the spacing of two hashes."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")
