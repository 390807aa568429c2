"""Rollouts with a Hugging Face model through our decode loop (:mod:`emapg.rollout.decode`):
batched, left-padded, n samples per prompt.

Per generated token it records, as the token is produced, the sampled token's log-prob under the
sampling distribution (after temperature and top-p), that distribution's top-k ids, its entropy and
the tail mass top-p removed: no extra forward pass (docs/METHOD.md section 5), and only one step's
``[rows, vocab]`` alive at a time.
"""

from __future__ import annotations

from torch import Tensor, nn

from emapg.models.lm import eval_mode
from emapg.rollout.batch import RolloutBatch, response_mask_from_lengths
from emapg.rollout.decode import KVState, decode, full_attention, prefill
from emapg.rollout.pool import decode_chunks, decode_pool
from emapg.rollout.sampling import Sampled, SamplingSpec, eos_ids, format_prompt, pad_left
from emapg.tasks.base import Example


def _repeat_runs(rows: list[list[int]]) -> int:
    """r when ``rows`` is runs of r identical rows (the n samples of each prompt), else 1."""
    r = 1
    while r < len(rows) and rows[r] == rows[0]:
        r += 1
    if r == 1 or len(rows) % r:
        return 1
    return r if all(rows[i] == rows[i - i % r] for i in range(len(rows))) else 1


def _fresh_inputs(contexts: list[list[int]], pad_id: int, model: nn.Module, share: bool,
                  device) -> tuple[Tensor, Tensor, KVState | None]:
    """Inputs for rows with no cache yet. With ``share``, runs of identical contexts (a prompt's n
    samples) prefill all but their last token once, and the cache is repeated for the run."""
    r = _repeat_runs(contexts) if share else 1
    if r > 1 and min(len(c) for c in contexts) > 1:
        ids, mask = pad_left(contexts[::r], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        state = prefill(model, ids[:, :-1], mask[:, :-1], repeat=r)
        return ids[:, -1:].repeat_interleave(r, 0), mask[:, -1:].repeat_interleave(r, 0), state
    ids, mask = pad_left(contexts, pad_id)
    return ids.to(device), mask.to(device), None


class HFSampler:
    """A sampler (see :data:`emapg.rollout.agent.Sampler`) over our decode loop.

    ``reuse_cache``: a call whose contexts each extend, in order, a row of the previous call (a
    multi-turn episode: its last turn, then retrieved information) feeds only the new tokens on top
    of that row's cache; rows of the previous call that are not continued are dropped. Any other call
    starts afresh. ``prefix_sharing``: a fresh call runs each prompt of a run of identical contexts once.
    """

    def __init__(self, model: nn.Module, tokenizer, spec: SamplingSpec, *, stop_strings: list[str] | None = None,
                 reuse_cache: bool = True, prefix_sharing: bool = True):
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.stop_strings, self.eos = stop_strings, eos_ids(model, tokenizer)
        self.reuse_cache, self.prefix_sharing = reuse_cache, prefix_sharing
        self.device = next(model.parameters()).device
        self.state: KVState | None = None

    def _continued_rows(self, contexts: list[list[int]]) -> list[int] | None:
        """The previous rows that ``contexts`` extend, one each and in order, or None."""
        if not (self.reuse_cache and self.state is not None and self.state.reusable):
            return None
        held, rows, j = self.state.tokens, [], 0
        for c in contexts:
            while j < len(held) and not (len(c) > len(held[j]) and c[: len(held[j])] == held[j]):
                j += 1
            if j == len(held):
                return None
            rows.append(j)
            j += 1
        return rows

    def __call__(self, contexts: list[list[int]], max_new_tokens: int) -> Sampled:
        rows = self._continued_rows(contexts)
        pad = self.tokenizer.pad_token_id
        if rows is not None:
            state = self.state.select(rows)
            ids, mask = pad_left([c[len(h) :] for c, h in zip(contexts, state.tokens, strict=True)], pad)
            ids, mask = ids.to(self.device), mask.to(self.device)
        else:
            self.state = None  # free the old cache before the new prefill
            ids, mask, state = _fresh_inputs(contexts, pad, self.model, self.prefix_sharing, self.device)
        with eval_mode(self.model):
            out, self.state = decode(self.model, ids, mask, state, self.spec, max_new_tokens=max_new_tokens,
                                     eos=self.eos, pad_id=pad, tokenizer=self.tokenizer,
                                     stop_strings=self.stop_strings, keep_state=self.reuse_cache)
        return out


def generate(model: nn.Module, tokenizer, examples: list[Example], spec: SamplingSpec, *,
             prefix_sharing: bool = True, max_rows: int | None = None) -> RolloutBatch:
    """Sample ``spec.n`` responses per example; returns a :class:`RolloutBatch` (rewards not yet set).

    Per token it records what ``spec`` asks (pi_samp's top-``spec.k`` ids among them); greedy
    decoding's samp_logp is the tempered log-prob of the argmax.
    prefix_sharing: run each prompt once (all but its last token) and repeat its key/value cache
        for its n samples, instead of running every prompt n times.
    max_rows: decode at most this many rows at a time (:mod:`emapg.rollout.pool`: rows join as others
        finish, a prompt's n samples sharing its cache); None = every row at once.
    """
    device = next(model.parameters()).device
    prompts = [format_prompt(tokenizer, ex.messages) for ex in examples]
    prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
    eos = eos_ids(model, tokenizer)
    if max_rows is not None and len(prompts) * spec.n > max_rows:
        bounded = decode_pool if full_attention(model) else decode_chunks
        with eval_mode(model):
            out = bounded(model, prompts, spec, max_rows=max_rows, eos=eos, pad_id=tokenizer.pad_token_id)
    else:
        sampler = HFSampler(model, tokenizer, spec, reuse_cache=False, prefix_sharing=prefix_sharing)
        out = sampler([p for p in prompts for _ in range(spec.n)], spec.max_new_tokens)
    mask, truncated = response_mask_from_lengths(out.ids, out.length, eos)
    return RolloutBatch(
        prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device), response_ids=out.ids,
        response_mask=mask, samp_logp=out.logp, n=spec.n, samp_topk=out.topk,
        top_p_cut=out.top_p_cut if out.top_p_cut is not None else out.logp.new_zeros(out.logp.shape),
        entropy=out.entropy, truncated=truncated,
        completions=tokenizer.batch_decode(out.ids.masked_fill(mask == 0, tokenizer.pad_token_id),
                                           skip_special_tokens=True),
    )
