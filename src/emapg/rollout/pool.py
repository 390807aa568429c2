"""Single-turn rollouts of more rows than fit at once: at most ``max_rows`` rows decode together, and
the next prompts' n samples join as soon as enough rows have finished (continuous batching over our
decode loop, :mod:`emapg.rollout.decode`).

Why: the decode loop reserves each row's key/value cache for its whole budget. The paper's math step
samples 128 prompts x 8 at up to 8k tokens, about 246 GB of bf16 cache for R1-Distill-1.5B: every row at
once cannot fit on one GPU, ``max_rows`` at a time can, and a rollout's peak memory then no longer
grows with ``prompts_per_step``.

When rows join, the rows still generating keep their cache, compacted: each row's real columns are
moved to the right end and the columns no row needs are dropped (positions come from the attention
mask, so nothing a row attends to changes), and the new rows' prompt caches are placed beside them.
Every row is then the same computation as in a batch of its own: a test checks each recorded
log-prob against a forward pass over the finished sequence.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from emapg.rollout.batch import pad_cat
from emapg.rollout.decode import COMPACT_BELOW, Record, ReservedLayer, choose, decode, forward_columns, prefill
from emapg.rollout.sampling import Sampled, SamplingSpec, pad_left, step_stats


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
    tokens each, recorded as :func:`emapg.rollout.decode.decode` records them. A prompt's n samples
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
