"""What a rollout is asked and what it gives, whatever samples (HF decode loop, vLLM, a user's engine): the
sampling spec, prompt formatting, padding, end-of-sequence ids, what a sampler returns, the per-token statistics of
a sampling distribution (docs/METHOD.md section 5), and :class:`RolloutBatch`, the one record that then travels
through a training step (docs/ARCHITECTURE.md) and is cut into its micro-batches here.

Every sampler records, per generated token and as it is produced: the sampled token's log-prob
under the sampling distribution (after temperature and top-p), that distribution's entropy, the
probability mass top-p removed from the tempered distribution, and its top-k ids. Only O(rows x k)
per token is kept, never ``[rows, vocab]`` beyond the current step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

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


@dataclass
class RolloutBatch:
    """P distinct prompts, n responses each, B = P * n responses (responses of a prompt adjacent).

    prompt_ids, prompt_mask: [P, Lp] left-padded prompts (mask 1 on real tokens).
    response_ids: [B, L] right-padded responses. response_mask: [B, L] 1 where the model generated
        the token and it counts in the loss (EOS included; padding, tool output excluded).
    samp_logp: [B, L] log-prob of each response token under the sampling distribution (after
        temperature and top-p). samp_topk: [B, L, k] that distribution's top-k ids, or None.
    top_p_cut: [B, L] probability mass the sampler could not draw (outside top-p), 0 when top_p = 1.
    entropy: [B, L] entropy of the sampling distribution at each position (a diagnostic).
    truncated: [B] the response hit the length budget without an end-of-sequence.
    rewards, advantages: [B], filled by the trainer.
    stats: per-response diagnostics [B] of a rollout (e.g. searches per episode), logged as means.
    row_prompt: [B] the prompt of each row, for a run of rows that cuts groups (a micro-batch packed by
        tokens: :meth:`row_batch`); None: the rows are prompt-major, n per prompt.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    samp_logp: Tensor
    n: int
    samp_topk: Tensor | None = None
    top_p_cut: Tensor | None = None
    entropy: Tensor | None = None
    truncated: Tensor | None = None
    completions: list[str] = field(default_factory=list)
    rewards: Tensor | None = None
    advantages: Tensor | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)
    row_prompt: Tensor | None = None

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The batch with every tensor on ``device``."""
        moved = {f: (v.to(device) if torch.is_tensor(v) else v) for f, v in self.__dict__.items()}
        moved["stats"] = {k: v.to(device) for k, v in self.stats.items()}
        return RolloutBatch(**moved)

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    def extent(self) -> Tensor:
        """[B] each row's response tokens up to and including the last one that counts (0: none counts): what a
        pass computes of the row (tool output before that token is context it runs too)."""
        cols = torch.arange(1, self.response_mask.shape[1] + 1, device=self.response_mask.device)
        return (self.response_mask.bool() * cols).amax(1)

    def rows(self, prompts: slice) -> slice:
        """Response rows of a slice of prompts."""
        return slice(prompts.start * self.n, prompts.stop * self.n)

    def micro_batches(self, size: int) -> list[RolloutBatch]:
        """The batch cut into consecutive micro-batches of ``size`` prompts (the last may be smaller)."""
        return [self.micro_batch(slice(s, min(s + size, self.num_prompts))) for s in range(0, self.num_prompts, size)]

    def micro_batch(self, prompts: slice) -> RolloutBatch:
        """The sub-batch of a run of prompts with all their responses, trimmed of all-padding columns
        (so a micro-batch of short answers runs short sequences)."""
        return self._sub(prompts, self.rows(prompts), None)

    def row_batch(self, rows: slice) -> RolloutBatch:
        """The sub-batch of a run of rows (of a prompt-major batch), which may begin or end inside a prompt's
        group: the prompts they answer, each once, and ``row_prompt`` naming each row's; trimmed as
        :meth:`micro_batch`."""
        first = rows.start // self.n
        prompts = slice(first, (rows.stop - 1) // self.n + 1)
        return self._sub(prompts, rows, torch.arange(rows.start, rows.stop, device=self.prompt_ids.device) // self.n
                         - first)

    def _sub(self, prompts: slice, rows: slice, row_prompt: Tensor | None) -> RolloutBatch:
        completions = self.completions[rows]
        pm = self.prompt_mask[prompts]
        p_cols = pm.any(0).nonzero()
        p_start = int(p_cols[0]) if len(p_cols) else pm.shape[1]
        rm = self.response_mask[rows]
        r_cols = rm.any(0).nonzero()
        r_end = int(r_cols[-1]) + 1 if len(r_cols) else 1
        cut = lambda t: None if t is None else t[rows, :r_end]  # noqa: E731
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return RolloutBatch(
            prompt_ids=self.prompt_ids[prompts, p_start:], prompt_mask=pm[:, p_start:],
            response_ids=self.response_ids[rows, :r_end], response_mask=rm[:, :r_end],
            samp_logp=self.samp_logp[rows, :r_end], n=self.n, samp_topk=cut(self.samp_topk),
            top_p_cut=cut(self.top_p_cut), entropy=cut(self.entropy), truncated=pick(self.truncated),
            completions=completions, rewards=pick(self.rewards), advantages=pick(self.advantages),
            stats={k: v[rows] for k, v in self.stats.items()}, row_prompt=row_prompt,
        )

    def per_row(self, prompt_rows: Tensor) -> Tensor:
        """A tensor with a row per prompt [P, ...] repeated for each response row [B, ...]."""
        return prompt_rows.repeat_interleave(self.n, 0) if self.row_prompt is None else prompt_rows[self.row_prompt]


def pad_cat(parts: list[Tensor | None], *, left: bool = False, fill: float = 0) -> Tensor | None:
    """Tensors [B_i, T_i, ...] stacked along rows, each padded with ``fill`` along dim 1 to the widest
    (on the left or the right); None when the first is None (a field a sampler does not record)."""
    if parts[0] is None:
        return None
    width = max(p.shape[1] for p in parts)
    pads = [(0, 0) * (p.dim() - 2) + ((width - p.shape[1], 0) if left else (0, width - p.shape[1])) for p in parts]
    return torch.cat([torch.nn.functional.pad(p, pad, value=fill) for p, pad in zip(parts, pads, strict=True)])


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """Batches of the same n, one after the other (prompts left-padded, responses right-padded to the
    widest; the padding, masked out, holds 0); scores are not carried (a rollout's parts are scored
    together)."""
    def stack(name: str, left: bool = False) -> Tensor | None:
        return pad_cat([getattr(b, name) for b in batches], left=left)

    first = batches[0]
    return RolloutBatch(
        prompt_ids=stack("prompt_ids", left=True), prompt_mask=stack("prompt_mask", left=True),
        response_ids=stack("response_ids"),
        response_mask=stack("response_mask"), samp_logp=stack("samp_logp"), n=first.n,
        samp_topk=stack("samp_topk"), top_p_cut=stack("top_p_cut"), entropy=stack("entropy"),
        truncated=torch.cat([b.truncated for b in batches]) if first.truncated is not None else None,
        completions=[c for b in batches for c in b.completions],
        stats={k: torch.cat([b.stats[k] for b in batches]) for k in first.stats},
    )


def response_mask_from_lengths(ids: Tensor, lengths: Tensor, eos_id: list[int]) -> tuple[Tensor, Tensor]:
    """Mask [B, L] of each row's first ``lengths`` [B] generated tokens, and truncated [B]: the row's
    last generated token is not an end-of-sequence token (it ran out of budget). Built from the lengths,
    not by looking for the first EOS: when the pad token is the EOS token, a row stopped without one
    (at its budget, at the engine's context limit) must not end at its first pad."""
    cols = torch.arange(ids.shape[1], device=ids.device)
    mask = (cols[None, :] < lengths[:, None]).long()
    last = ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    eos = torch.tensor(eos_id, device=ids.device)
    return mask, ~torch.isin(last, eos) | (lengths == 0)
