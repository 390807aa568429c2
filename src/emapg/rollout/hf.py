"""Rollouts with a Hugging Face model through emapg's own decode loop: batched, left-padded, n samples per prompt.

Per generated token it records, as the token is produced, the sampled token's log-prob under the
sampling distribution (after temperature and top-p), that distribution's top-k ids, its entropy and
the tail mass top-p removed: no extra forward pass (docs/METHOD.md section 5), and only one step's
``[rows, vocab]`` alive at a time.

Why our own loop rather than ``generate``: it records each token's statistics as the token is
produced (``generate`` can only hand back every step's ``[rows, vocab]`` scores at the end, 0.6 TB
for the paper's 128 x 8 rows at 8k tokens), and it keeps the cache of a row alive between calls, so
a multi-turn episode feeds only its new tokens each turn. Token for token it draws what
``generate`` draws (same forward inputs, same softmax and ``torch.multinomial`` calls, finished rows
padded alike): a test checks it, and ``bench/generation.py`` measures both.

A :class:`KVState` is the cache of B rows plus, per row, the real tokens it holds (columns a row
wrote after its end are masked out and never attended).

**More rows than fit at once** (:func:`decode_pool`): at most ``max_rows`` rows decode together, and the next
prompts' n samples join as soon as enough rows have finished (continuous batching). Why: the loop reserves each
row's key/value cache for its whole budget. The paper's math step samples 128 prompts x 8 at up to 8k tokens,
about 246 GB of bf16 cache for R1-Distill-1.5B: every row at once cannot fit on one GPU, ``max_rows`` at a time
can, and a rollout's peak memory then no longer grows with ``prompts_per_step``. When rows join, the rows still
generating keep their cache, compacted: each row's real columns are moved to the right end and the columns no row
needs are dropped (positions come from the attention mask, so nothing a row attends to changes), and the new
rows' prompt caches are placed beside them. Every row is then the same computation as in a batch of its own: a
test checks each recorded log-prob against a forward pass over the finished sequence.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from emapg.models.lm import cache_kwarg, decoder_and_head, eval_mode, positions
from emapg.rollout.sampling import (
    RolloutBatch,
    Sampled,
    SamplingSpec,
    draw,
    eos_ids,
    format_prompt,
    pad_cat,
    pad_left,
    response_mask_from_lengths,
    step_stats,
    warp,
)
from emapg.tasks.base import Example


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer that writes new columns into a buffer reserved ahead (``spare``
    columns beyond what it holds), where ``DynamicLayer`` concatenates: appending a token then costs
    one column, not a copy of the whole cache (a quadratic cost over a long generation)."""

    def __init__(self, spare: int = 0):
        super().__init__()
        self.spare, self.length = spare, 0
        self.kbuf = self.vbuf = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.kbuf is None or end > self.kbuf.shape[-2]:
            self.kbuf, self.vbuf = (self._grown(buf, new, end + self.spare)
                                    for buf, new in ((self.kbuf, key_states), (self.vbuf, value_states)))
        self.kbuf[..., self.length : end, :].copy_(key_states)
        self.vbuf[..., self.length : end, :].copy_(value_states)
        self.length = end
        self.keys, self.values = self.kbuf[..., :end, :], self.vbuf[..., :end, :]
        return self.keys, self.values

    def _grown(self, buf: Tensor | None, new: Tensor, capacity: int) -> Tensor:
        out = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]), dtype=store_dtype(new))
        if buf is not None:
            out[..., : self.length, :].copy_(buf[..., : self.length, :])
        return out

    @classmethod
    def holding(cls, parts: list[tuple[Tensor, Tensor]], rows: int, width: int, spare: int) -> ReservedLayer:
        """A layer of ``rows`` rows holding the (keys, values) ``parts`` stacked in order, each
        right-aligned to ``width`` columns (zeros before: masked columns must hold finite numbers,
        attention multiplies them by 0), with ``spare`` free columns after."""
        k0, v0 = parts[0]
        layer = cls(spare)
        layer.lazy_initialization(k0, v0)
        layer.kbuf = k0.new_zeros((rows, k0.shape[1], width + spare, k0.shape[3]))
        layer.vbuf = v0.new_zeros((rows, v0.shape[1], width + spare, v0.shape[3]))
        at = 0
        for k, v in parts:
            layer.kbuf[at : at + k.shape[0], :, width - k.shape[2] : width].copy_(k)
            layer.vbuf[at : at + v.shape[0], :, width - v.shape[2] : width].copy_(v)
            at += k.shape[0]
        layer.length = width
        layer.keys, layer.values = layer.kbuf[..., :width, :], layer.vbuf[..., :width, :]
        return layer

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kbuf is not None:
            self.kbuf, self.vbuf = self.kbuf.repeat_interleave(repeats, 0), self.vbuf.repeat_interleave(repeats, 0)
            self.keys, self.values = self.kbuf[..., : self.length, :], self.vbuf[..., : self.length, :]

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.kbuf is not None:
            self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
            self.keys, self.values = self.kbuf[..., : self.length, :], self.vbuf[..., : self.length, :]


def store_dtype(t: Tensor) -> torch.dtype:
    """The dtype a cache keeps ``t`` in: autocast's when it is on (under autocast with fp32 weights the
    rotary embedding hands back fp32 keys beside bf16 values; attention casts both to bf16 anyway, so
    keeping keys in fp32 would only take 1.5x the memory), else its own."""
    device = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


def full_attention(model: nn.Module) -> bool:
    """Whether every layer of ``model`` attends to the whole context (no sliding-window or linear-attention
    layers, whose caches forget columns)."""
    cfg = getattr(model, "config", None)
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    sliding = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    return types == {"full_attention"} and not sliding


def new_cache(model: nn.Module, spare: int = 0) -> Cache:
    """An empty cache for ``model``: reserved full-attention layers when :func:`full_attention`, else the
    model's own ``DynamicCache``."""
    if full_attention(model):
        return Cache(layer_class_to_replicate=functools.partial(ReservedLayer, spare))
    return DynamicCache(config=getattr(model, "config", None))


def _reserve(cache, spare: int) -> None:
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, ReservedLayer):
            layer.spare = spare


COMPACT_BELOW = 0.875


@dataclass
class KVState:
    """The key/value cache of B rows. mask: [B, C] 1 on the cache columns holding a row's real tokens;
    tokens: the real tokens each row's cache holds, in order (what a continuation must start with)."""

    cache: Cache
    mask: Tensor
    tokens: list[list[int]]

    def select(self, rows: list[int]) -> KVState:
        """The state of some rows (in this order); the others' cache is freed."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(idx)
        return KVState(cache=self.cache, mask=self.mask[idx], tokens=[self.tokens[r] for r in rows])

    @property
    def reusable(self) -> bool:
        """False for caches that forget columns (sliding-window or linear-attention layers)."""
        return not (any(getattr(self.cache, "is_sliding", [])) or any(getattr(self.cache, "is_linear", [])))


def forward_columns(model: nn.Module, ids: Tensor, mask: Tensor, cache) -> Tensor:
    """One forward of new columns ``ids`` [B, T], appended to ``cache``; ``mask`` [B, C + T] covers the
    cache's columns and these. Returns the fp32 logits at the last column [B, V]."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)[:, -ids.shape[1] :],
                use_cache=True, logits_to_keep=1, **{cache_kwarg(decoder_and_head(model)[0]): cache})
    return out.logits[:, -1].to(copy=True, dtype=torch.float32)


@torch.no_grad()
def prefill(model: nn.Module, ids: Tensor, mask: Tensor, repeat: int = 1) -> KVState:
    """The cache of left-padded rows ``ids`` / ``mask`` [P, L], repeated ``repeat`` times per row
    (prefix sharing: n samples of a prompt share its cache)."""
    cache = new_cache(model)
    forward_columns(model, ids, mask, cache)
    rows = [r[m.bool()].tolist() for r, m in zip(ids.cpu(), mask.cpu(), strict=True)]
    if repeat > 1:
        cache.batch_repeat_interleave(repeat)
        mask = mask.repeat_interleave(repeat, 0)
        rows = [r for r in rows for _ in range(repeat)]
    return KVState(cache=cache, mask=mask, tokens=rows)


_ENDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {stops: ids}


def stop_enders(tokenizer, stops: list[str], device) -> Tensor:
    """The ids of the tokens whose text holds the last character of one of ``stops``: only such a token
    can complete a stop string, so only rows that just drew one need their text decoded. Each id decoded
    alone, once per tokenizer and stop list (a superset is harmless: it only costs a decode)."""
    known = _ENDERS.setdefault(tokenizer, {})
    if tuple(stops) not in known:
        last = {s[-1] for s in stops if s}
        size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        texts = tokenizer.batch_decode([[i] for i in range(size)])
        known[tuple(stops)] = torch.tensor([i for i, t in enumerate(texts) if any(c in t for c in last)],
                                           dtype=torch.long)
    return known[tuple(stops)].to(device)


def _stop_hits(tokenizer, generated: Tensor, tok: Tensor, enders: Tensor, stops: list[str]) -> Tensor:
    """[B] whether a row's last generated tokens (one more than the longest stop string's characters) contain
    one of ``stops``, decoding only the rows whose newest token ``tok`` [B] is one of ``enders`` (one device
    read for the step)."""
    window = max(len(s) for s in stops) + 1
    hit = torch.zeros(tok.shape[0], dtype=torch.bool, device=tok.device)
    rows = torch.isin(tok, enders).nonzero().squeeze(1).tolist()
    if rows:
        tails = tokenizer.batch_decode(generated[rows, -window:].tolist(), skip_special_tokens=True)
        found = [r for r, t in zip(rows, tails, strict=True) if any(s in t for s in stops)]
        hit[found] = True
    return hit


@dataclass
class Record:
    """What :func:`decode` records for B rows, filled as the tokens are produced: [B, T] each (top-k
    ids [B, T, k]), and [B] tokens each row generated."""

    ids: Tensor
    logp: Tensor
    entropy: Tensor
    cut: Tensor | None
    topk: Tensor | None
    length: Tensor

    @classmethod
    def empty(cls, b: int, steps: int, spec: SamplingSpec, pad_id: int, device) -> Record:
        logp = torch.zeros((b, steps), dtype=torch.float32, device=device)
        return cls(ids=torch.full((b, steps), pad_id, dtype=torch.long, device=device), logp=logp,
                   entropy=torch.zeros_like(logp),
                   cut=torch.zeros_like(logp) if spec.top_p < 1.0 and not spec.greedy else None,
                   topk=torch.zeros((b, steps, spec.k), dtype=torch.long, device=device) if spec.k > 0 else None,
                   length=torch.zeros(b, dtype=torch.long, device=device))

    def put(self, rows: Tensor, t: int | Tensor, tok: Tensor, st, lost: Tensor | None, live: Tensor) -> None:
        """Record the tokens of ``rows`` at column ``t`` (one for all, or [rows] columns of their own)."""
        self.ids[rows, t], self.logp[rows, t], self.entropy[rows, t] = tok, st.logp, st.entropy
        if self.cut is not None:
            self.cut[rows, t] = lost
        if self.topk is not None:
            self.topk[rows, t] = st.topk
        self.length[rows] += live

    def sampled(self, steps: int) -> Sampled:
        return Sampled(ids=self.ids[:, :steps], logp=self.logp[:, :steps], entropy=self.entropy[:, :steps],
                       top_p_cut=None if self.cut is None else self.cut[:, :steps],
                       topk=None if self.topk is None else self.topk[:, :steps], length=self.length)


def choose(logits: Tensor, spec: SamplingSpec, b: int, rows: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """The next token of each computed row: (tokens, the sampling distribution's scores, the tail mass
    top-p cut or None). One uniform per row of the whole batch (``b``) at every step: the same draws
    whether or not finished rows have left the batch."""
    if spec.greedy:
        return torch.argmax(logits, -1), logits / spec.temperature, None
    scores, lost = warp(logits, spec.temperature, spec.top_p)
    u = torch.rand((b, 1), dtype=torch.float64, device=logits.device)
    return draw(torch.softmax(scores, -1), u[rows]), scores, lost


def _carried_state(cache, mask: Tensor, state: KVState | None, new_ids: Tensor, new_mask: Tensor,
                   rec: Record, steps: int) -> KVState:
    """The state after a decode: the cache columns of the fed tokens (those a row fed after its end
    masked out), and per row the real tokens the cache holds (all but the last one generated)."""
    fed = steps - 1
    keep = (torch.arange(fed, device=mask.device)[None, :] < (rec.length - 1)[:, None]).to(mask.dtype)
    mask = torch.cat([mask[:, : mask.shape[1] - fed], keep], 1)
    prev = state.tokens if state is not None else [[] for _ in range(new_ids.shape[0])]
    gen = rec.ids[:, :steps].tolist()
    news = [r[m.bool()].tolist() for r, m in zip(new_ids.cpu(), new_mask.cpu(), strict=True)]
    tokens = [p + nw + g[: int(n) - 1] for p, nw, g, n in zip(prev, news, gen, rec.length.tolist(), strict=True)]
    return KVState(cache=cache, mask=mask, tokens=tokens)


@torch.no_grad()
def decode(
    model: nn.Module,
    new_ids: Tensor,
    new_mask: Tensor,
    state: KVState | None,
    spec: SamplingSpec,
    *,
    max_new_tokens: int,
    eos: list[int],
    pad_id: int,
    tokenizer=None,
    stop_strings: list[str] | None = None,
    keep_state: bool = True,
) -> tuple[Sampled, KVState | None]:
    """Continue B rows: feed ``new_ids`` / ``new_mask`` [B, T] (left-padded columns not yet in the
    cache of ``state``; None = no cache) and sample up to ``max_new_tokens`` tokens per row as ``spec``
    says (its temperature, top_p, greedy and k; the call's own budget replaces spec.max_new_tokens).

    A row ends at an EOS id or when its generated text contains a stop string (needs ``tokenizer``);
    later positions hold ``pad_id``. Per token it records the sampling distribution's (after
    temperature and top-p) log-prob of the token, entropy, tail mass and top-k ids; greedy decoding
    takes the argmax and records the tempered distribution. Only one step's ``[B, vocab]`` is alive.

    Returns the :class:`Sampled` tokens and the state whose cache holds every row's real tokens but the last
    one generated (not yet fed). ``keep_state=False`` returns no state, and lets rows leave the batch once they
    finish (when fewer than ``COMPACT_BELOW`` of the computed rows still generate)."""
    device, b = new_ids.device, new_ids.shape[0]
    mask = new_mask if state is None else torch.cat([state.mask, new_mask], 1)
    cache = new_cache(model, spare=max_new_tokens) if state is None else state.cache
    _reserve(cache, new_ids.shape[1] + max_new_tokens)
    logits = forward_columns(model, new_ids, mask, cache)
    rec = Record.empty(b, max_new_tokens, spec, pad_id, device)
    unfinished = torch.ones(b, dtype=torch.long, device=device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    enders = stop_enders(tokenizer, stop_strings, device) if stop_strings else None
    rows, steps = torch.arange(b, device=device), 0  # the rows the cache and the logits hold (all, unless compacted)
    for t in range(max_new_tokens):
        tok, scores, lost = choose(logits, spec, b, rows)
        st = step_stats(scores, tok, spec.k)
        live = unfinished[rows]
        tok = tok * live + pad_id * (1 - live)
        rec.put(rows, t, tok, st, lost, live)
        done = torch.isin(tok, eos_t)
        if stop_strings:
            done |= _stop_hits(tokenizer, rec.ids[rows, : t + 1], tok, enders, stop_strings)
        live = live & ~done
        unfinished[rows] = live
        steps = t + 1
        n_live = int(live.sum())  # the step's one host sync (tests/test_decode.py counts them): stop? compact?
        if n_live == 0 or steps == max_new_tokens:
            break
        if not keep_state and n_live < COMPACT_BELOW * len(rows):
            # finished rows leave the batch: later steps compute only the rows still generating
            keep = live.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, mask, tok = rows[keep], mask[keep], tok[keep]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], 1)
        logits = forward_columns(model, tok[:, None], mask, cache)
    carried = _carried_state(cache, mask, state, new_ids, new_mask, rec, steps) if keep_state else None
    return rec.sampled(steps), carried


def _right_aligned(mask: Tensor) -> Tensor:
    """[R, W] column indices that move each row's real columns (mask = 1) to the right end, in order,
    W = the most real columns of any row; the columns before a row's real ones are masked ones."""
    width = int(mask.sum(1).max())
    order = torch.sort(mask, dim=1, stable=True).indices  # masked columns first, real ones after, in order
    return order[:, mask.shape[1] - width :]


def _joined(kept: Cache | None, kept_mask: Tensor | None, new: Cache | None, new_mask: Tensor,
            spare: int) -> tuple[Cache, Tensor]:
    """One cache of the kept rows (compacted, right-aligned) and the new rows below them, with
    ``spare`` free columns per row, and its [R + N, W] attention mask."""
    if kept is not None:
        index = _right_aligned(kept_mask)
        kept_mask = kept_mask.gather(1, index)
    width = max(kept_mask.shape[1] if kept is not None else 0, new_mask.shape[1])
    parts = ([kept_mask] if kept is not None else []) + [new_mask]
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in parts])
    layers = []
    for i in range(len((kept if kept is not None else new).layers)):
        srcs = []
        if kept is not None:
            lay = kept.layers[i]
            gather = index[:, None, :, None]
            srcs.append((lay.keys.gather(2, gather.expand(-1, lay.keys.shape[1], -1, lay.keys.shape[3])),
                         lay.values.gather(2, gather.expand(-1, lay.values.shape[1], -1, lay.values.shape[3]))))
        if new is not None:
            srcs.append((new.layers[i].keys, new.layers[i].values))
        layers.append(ReservedLayer.holding(srcs, mask.shape[0], width, spare))
    return Cache(layers=layers), mask


@torch.no_grad()
def decode_chunks(model: nn.Module, prompts: list[list[int]], spec: SamplingSpec, *, max_rows: int,
                  eos: list[int], pad_id: int) -> Sampled:
    """:func:`decode_pool`'s rows, for models whose cache forgets columns (sliding-window or linear
    attention layers, which cannot be compacted): whole prompts' n samples, ``max_rows`` rows (at least
    one prompt) at a time, one batch after the other."""
    per, device = max(1, max_rows // spec.n), next(model.parameters()).device
    outs = []
    for i in range(0, len(prompts), per):
        ids, mask = pad_left([p for p in prompts[i : i + per] for _ in range(spec.n)], pad_id)
        out, _ = decode(model, ids.to(device), mask.to(device), None, spec, max_new_tokens=spec.max_new_tokens,
                        eos=eos, pad_id=pad_id, keep_state=False)
        outs.append(out)
    cat = lambda name, fill: pad_cat([getattr(o, name) for o in outs], fill=fill)  # noqa: E731
    return Sampled(ids=cat("ids", pad_id), logp=cat("logp", 0.0), entropy=cat("entropy", 0.0),
                   top_p_cut=cat("top_p_cut", 0.0), topk=cat("topk", 0), length=torch.cat([o.length for o in outs]))


@torch.no_grad()
def decode_pool(model: nn.Module, prompts: list[list[int]], spec: SamplingSpec, *, max_rows: int,
                eos: list[int], pad_id: int) -> Sampled:
    """``spec.n`` samples of each prompt (rows prompt-major: prompt i's sample j is row i * n + j), at
    most ``max_rows`` rows decoding at a time (at least one prompt's n), up to ``spec.max_new_tokens``
    tokens each, recorded as :func:`emapg.rollout.hf.decode` records them. A prompt's n samples
    share its cache (prefix sharing) and join together when n rows are free.

    The draws: one uniform per row of the whole call at every step, as in ``decode``; a row's tokens
    depend on when it joined, so they equal ``decode``'s only when every row fits at once."""
    device, n, budget = next(model.parameters()).device, spec.n, spec.max_new_tokens
    b = len(prompts) * n
    rec = Record.empty(b, budget + 1, spec, pad_id, device)  # column ``budget``: where finished rows write
    col = torch.zeros(b, dtype=torch.long, device=device)  # each row's next column
    unfinished = torch.ones(b, dtype=torch.long, device=device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    waiting = deque(range(len(prompts)))
    rows = torch.zeros(0, dtype=torch.long, device=device)
    cache, mask, tok, n_live = None, None, None, 0
    join_at = max(n, int((1 - COMPACT_BELOW) * max_rows))  # free rows that make a join worth its copy
    while True:
        free = max_rows - n_live
        if waiting and (free >= join_at or n_live == 0):
            keep = unfinished[rows].nonzero().squeeze(1)
            if n_live == 0:
                cache = None  # nothing to keep
            elif cache is not None:
                cache.batch_select_indices(keep)
            groups = [waiting.popleft() for _ in range(min(len(waiting), max(1, free // n)))]
            new_rows = torch.tensor([g * n + j for g in groups for j in range(n)], dtype=torch.long, device=device)
            ids, pmask = pad_left([prompts[g] for g in groups], pad_id)
            ids, pmask = ids.to(device), pmask.to(device)
            state = prefill(model, ids[:, :-1], pmask[:, :-1], repeat=n) if ids.shape[1] > 1 else None
            cache, mask = _joined(cache, None if cache is None else mask[keep], state and state.cache,
                                  pmask[:, :-1].repeat_interleave(n, 0), spare=budget + 1)
            feed = torch.cat([tok[keep], ids[:, -1].repeat_interleave(n, 0)]) if tok is not None else \
                ids[:, -1].repeat_interleave(n, 0)
            rows = torch.cat([rows[keep], new_rows])
        elif n_live < COMPACT_BELOW * len(rows):
            keep = unfinished[rows].nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, mask, feed = rows[keep], mask[keep], tok[keep]
        else:
            feed = tok
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], 1)
        logits = forward_columns(model, feed[:, None], mask, cache)
        tok, scores, lost = choose(logits, spec, b, rows)
        was = unfinished[rows]
        tok = tok * was + pad_id * (1 - was)
        at = col[rows]
        rec.put(rows, at, tok, step_stats(scores, tok, spec.k), lost, was)
        live = was & ~(torch.isin(tok, eos_t) | (at + 1 >= budget))
        unfinished[rows], col[rows] = live, at + was
        n_live = int(live.sum())  # the step's one host sync
        if n_live == 0 and not waiting:
            break
    return rec.sampled(int(rec.length.max()))


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
    max_rows: decode at most this many rows at a time (:mod:`emapg.rollout.hf`: rows join as others
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
