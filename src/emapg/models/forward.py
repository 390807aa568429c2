"""One model pass over a micro-batch of rollouts: per-response-token log-prob statistics.

The anchor pass and the policy pass of docs/METHOD.md section 5 are both this function. Two paths, equal
in value and gradient (a test checks it):

* ``prefix_sharing=True`` (default): each distinct prompt runs once; its key/value cache is
  repeated for its n responses, and gradients flow back through the cache into the prompt.
  With n = 4 and prompts longer than responses this skips most of the compute. The responses
  then run in groups of similar length, each trimmed to its own longest (padding costs nothing).
* ``prefix_sharing=False``: the plain full-sequence forward, prompt repeated n times.

Logits are never formed for prompt positions, nor for padding: hidden states of the response
positions go to :func:`emapg.models.lm.token_logprobs`, which works chunk by chunk.

:func:`model_logprobs` is the pass the trainer calls: the same, through FSDP's hooks when the model
is sharded (:data:`SHARD_METHODS` is what :func:`emapg.models.distributed.shard` registers for it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import fields

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from emapg.models import distributed
from emapg.models.lm import TokenLogprobs, cache_kwarg, decoder_and_head, head_transform, positions, token_logprobs
from emapg.rollout.sampling import RolloutBatch


class _PrefixLayer(DynamicLayer):
    """A prompt's keys/values that the response pass reads and never grows: ``update`` returns them with
    the new columns after and stores nothing. So a checkpointed layer, replayed in the backward pass,
    sees the same cache, and no second copy of the response's keys is kept beside autograd's."""

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)


def _prefix_cache(cache, rows: Tensor | None = None) -> Cache:
    """A read-only cache of ``cache``'s columns (of some rows, or all)."""
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])  # noqa: E731
    return Cache(layers=[_PrefixLayer(pick(layer.keys), pick(layer.values)) for layer in cache.layers])


def _checkpointing(decoder: nn.Module) -> list[nn.Module]:
    """The layers transformers checkpoints in this pass (:func:`emapg.models.lm.set_pass_mode` turns them on)."""
    if not torch.is_grad_enabled():
        return []
    return [m for m in decoder.modules()
            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training]


def _plain(m: nn.Module, *args, **kwargs):
    """``m``'s forward outside transformers' checkpointing (its flag off for this call, a replay included)."""
    was, m.training = m.training, False
    try:
        return type(m).forward(m, *args, **kwargs)
    finally:
        m.training = was


@contextlib.contextmanager
def _layers(layers: list[nn.Module], checkpointed: bool) -> Iterator[None]:
    """Inside the block, ``layers`` run outside transformers' checkpointing (which drops any cache
    given to a layer): plainly, or each checkpointed by us with its cache (a read-only one)."""
    for m in layers:
        m.training = False  # transformers before 5.20 checks the flag in __call__, later ones in forward
        call = functools.partial(_plain, m)
        m.forward = functools.partial(checkpoint, call, use_reentrant=False) if checkpointed else call
    try:
        yield
    finally:
        for m in layers:
            m.training = True
            m.__dict__.pop("forward", None)


def response_hidden(model: nn.Module, mb: RolloutBatch, prefix_sharing: bool = True, agree: bool = False) -> Tensor:
    """Hidden states [B, L, H] at the positions that predict each response token.

    With gradient checkpointing on and prefix sharing, the prompt pass keeps its activations (it is
    short, and its layers must write the cache) and the response pass checkpoints every layer, reading
    the prompt's cache through a read-only :class:`_PrefixLayer` so that a replay sees the same cache.

    ``agree``: the model is sharded and not gathered, so each decoder call is a sequence of collectives
    (an all-gather per unit, and in the backward a reduce-scatter) that every rank must make alike. Then the
    number of calls depends on nothing a rank's rows decide: the length groups are planned from every rank's
    costs (:func:`_length_groups`), every group runs a call (at least one column wide), and a micro-batch
    whose responses count no position (all masked, or one token) still runs its response call, on one
    column of padding whose output no position reads. Ranks' micro-batches may differ in rows (packed by
    tokens), which the plan allows for.

    A micro-batch whose rows cut prompts' groups (``mb.row_prompt``) runs each of its prompts once too, each
    row reading its own prompt's keys and values."""
    decoder, _ = decoder_and_head(model)
    resp, pmask = mb.response_ids, mb.prompt_mask
    inputs = resp[:, :-1]  # the last response token predicts nothing we need
    if not prefix_sharing:
        full_ids = torch.cat([mb.per_row(mb.prompt_ids), inputs], 1)
        full_mask = torch.cat([mb.per_row(pmask), torch.ones_like(inputs)], 1)
        h = decoder(input_ids=full_ids, attention_mask=full_mask, position_ids=positions(full_mask),
                    use_cache=False).last_hidden_state
        return h[:, pmask.shape[1] - 1 :]
    ckpt = _checkpointing(decoder)
    with _layers(ckpt, checkpointed=False):
        out = decoder(input_ids=mb.prompt_ids, attention_mask=pmask, position_ids=positions(pmask), use_cache=True)
    h_first = mb.per_row(out.last_hidden_state[:, -1:])  # left padding: last column is real
    width = inputs.shape[1]
    if width == 0:
        if not agree:
            return h_first
        inputs = torch.zeros_like(resp[:, :1])  # a call on one column of padding: its output is dropped below
    cache = getattr(out, "cache", None) or out.past_key_values
    if ckpt and not all(type(layer) is DynamicLayer for layer in cache.layers):
        return response_hidden(model, mb, prefix_sharing=False)  # sliding-window layers: the plain pass
    # each row's copy of its prompt's keys/values, autograd-tracked: gradients reach the prompt's
    if mb.row_prompt is None:
        cache.batch_repeat_interleave(mb.n)
    else:
        cache.batch_select_indices(mb.row_prompt)
    att = torch.cat([mb.per_row(pmask), torch.ones_like(inputs)], 1)
    pos = mb.per_row(pmask.sum(1, keepdim=True)) + torch.arange(inputs.shape[1], device=inputs.device)
    # Rows run in groups of similar length, each trimmed to its own longest: padding costs no compute.
    # Inputs up to a row's last counted position are needed (tool output before it is context).
    need = (mb.extent() - 1).clamp(min=0)  # inputs each row needs (0: none)
    sliding = any(getattr(cache, "is_sliding", []))
    groups = _length_groups(need, sliding=sliding, agree=agree)
    with _layers(ckpt, checkpointed=True):
        if len(groups) == 1:
            sub = cache if sliding else _prefix_cache(cache)
            h = decoder(input_ids=inputs, attention_mask=att, position_ids=pos, use_cache=True,
                        **{cache_kwarg(decoder): sub}).last_hidden_state
        else:
            h = _grouped_pass(decoder, inputs, att, pos, cache, groups, need, agree, like=h_first)
    return torch.cat([h_first, h[:, :width]], 1)


def _grouped_pass(decoder: nn.Module, inputs: Tensor, att: Tensor, pos: Tensor, cache, groups: list[Tensor],
                  need: Tensor, agree: bool, like: Tensor) -> Tensor:
    """The responses' pass in length groups, each group trimmed to its longest row, reading the prompts'
    cache; hidden states [rows, inputs' width] in the rows' order (zeros past a row's need; dtype and device
    of ``like``)."""
    parts, cols = [], inputs.shape[1]
    lp = att.shape[1] - cols
    for rows in groups:
        w = int(need[rows].max())
        if w == 0 and not agree:
            parts.append(like.new_zeros((len(rows), cols, like.shape[-1])))
            continue
        w = max(w, 1)  # sharded: every group makes its call
        h = decoder(input_ids=inputs[rows, :w], attention_mask=att[rows, : lp + w], position_ids=pos[rows, :w],
                    use_cache=True, **{cache_kwarg(decoder): _prefix_cache(cache, rows)}).last_hidden_state
        parts.append(torch.nn.functional.pad(h, (0, 0, 0, cols - w)))
    return torch.cat(parts)[torch.argsort(torch.cat(groups))]


GROUP_OVERHEAD_TOKENS = 64  # what one more decoder call costs, in tokens of compute (CPU, small models)


GROUP_PARTS = (1, 2, 4)  # the plans: the rows, longest first, cut into this many groups


def _length_groups(need: Tensor, sliding: bool, agree: bool = False) -> list[Tensor]:
    """Row indices split into 1, 2 or 4 groups of similar length (longest first), whichever runs the
    fewest padded tokens counting a call's overhead; one group for sliding-window caches. A plan has no
    more groups than rows.

    ``agree``: the plan is the same on every rank (one all-reduce): the one whose slowest rank runs the
    fewest tokens, among those with no more groups than the rank with the fewest rows has (ranks' micro-batches
    packed by tokens differ in rows); each of its groups is then non-empty on every rank."""
    order = torch.argsort(need, descending=True, stable=True)
    if sliding:
        return [order]
    plans = [order.tensor_split(parts) for parts in GROUP_PARTS]
    costs = [sum(float(need[g].max()) * len(g) + GROUP_OVERHEAD_TOKENS for g in groups if len(g)) for groups in plans]
    rows = len(need)
    if agree:
        *costs, fewest = distributed.all_reduce([*costs, -rows], op="max")
        rows = -int(fewest)
    usable = [i for i, parts in enumerate(GROUP_PARTS) if parts <= max(rows, 1)]
    return list(plans[min(usable, key=lambda i: (costs[i], i))])


def response_logprobs(
    model: nn.Module,
    mb: RolloutBatch,
    *,
    temperature: float = 1.0,
    ids: Tensor | None = None,
    k_self: int = 0,
    entropy: bool = False,
    chunk_size: int = 1024,
    prefix_sharing: bool = True,
    agree: bool = False,
) -> TokenLogprobs:
    """Log-prob statistics of the response tokens, only at valid (mask = 1) positions.

    ids: [N, k] ids to gather log-probs at (the top-k head) at each valid position, or None.
    Returns a :class:`TokenLogprobs` whose fields are [N] / [N, k] over the N = mask.sum()
    valid positions, in row-major order (``tensor[mask.bool()]`` order).
    """
    _, head = decoder_and_head(model)
    hidden = response_hidden(model, mb, prefix_sharing, agree=agree)
    valid = mb.response_mask.bool()
    return token_logprobs(
        hidden[valid], head.weight, mb.response_ids[valid], ids=ids,
        bias=getattr(head, "bias", None), temperature=temperature, k_self=k_self, entropy=entropy,
        chunk_size=chunk_size, transform=head_transform(model),
    )


LOGPROBS_METHOD = "emapg_logprobs"


def _logprobs_method(self: nn.Module, mb, **kwargs) -> dict[str, Tensor | None]:
    # A dict of tensors (a pytree), so FSDP sees the outputs and hooks their backward. Sharded and not
    # gathered: every rank makes the same decoder calls (response_hidden's ``agree``).
    st = response_logprobs(self, mb, agree=distributed.world() > 1, **kwargs)
    return {f.name: getattr(st, f.name) for f in fields(st)}


SHARD_METHODS = {LOGPROBS_METHOD: _logprobs_method}


def model_logprobs(model: nn.Module, mb: RolloutBatch, **kwargs) -> TokenLogprobs:
    """:func:`response_logprobs`, through FSDP's hooks when the model is sharded (with SHARD_METHODS)."""
    if distributed.is_sharded(model):
        out = TokenLogprobs(**getattr(model, LOGPROBS_METHOD)(mb, **kwargs))
        if not torch.is_grad_enabled():
            distributed.reshard(model)  # FSDP keeps the root unit gathered after forward, waiting for a backward
        return out
    return response_logprobs(model, mb, **kwargs)
