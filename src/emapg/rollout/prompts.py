"""Prompts that do not fit: a data file's prompt plus its response budget beyond the model's context
is found before the first step, and refused (naming the file and the row) or cut to fit. Also the
longest sequence a run can make (prompt + response budget), which sizes the vLLM engine."""

from __future__ import annotations

import dataclasses
import math
import random
import sys

from emapg.errors import ConfigError
from emapg.models.lm import longest_token_bytes
from emapg.rollout.sampling import format_prompt
from emapg.tasks.base import Example, Task, draw_examples


def context_length(model) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings), or None if it says none."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


ELLIPSIS = " [...] "


def _truncated(tokenizer, ex: Example, room: int) -> Example | None:
    """``ex`` with the middle of its user message's text cut out (its start and its end, where the
    question and the instruction stand, are kept) so that the whole prompt fits ``room`` tokens."""
    i = max(j for j, m in enumerate(ex.messages) if m["role"] in ("user", "raw"))
    ids = tokenizer(ex.messages[i]["content"], add_special_tokens=False).input_ids
    fixed = len(format_prompt(tokenizer, ex.messages)) - len(ids)
    keep = room - fixed - len(tokenizer(ELLIPSIS, add_special_tokens=False).input_ids) - 2  # re-tokenising slack
    if keep < 2:
        return None
    head, tail = ids[: keep // 2], ids[len(ids) - (keep - keep // 2) :]
    messages = [dict(m) for m in ex.messages]
    messages[i]["content"] = tokenizer.decode(head) + ELLIPSIS + tokenizer.decode(tail)
    if len(format_prompt(tokenizer, messages)) > room:
        return None
    return dataclasses.replace(ex, messages=messages)


def _bounded(ex: Example, room: int, per_token: int) -> tuple[Example, bool]:
    """``ex`` whose user message is cut, head and tail kept, to at most ``room * per_token`` bytes' worth of
    characters when it is longer (no prompt that long could fit: it needs more than ``room`` tokens), so that
    nothing tokenizes a text of megabytes; and whether it was cut."""
    i = max(j for j, m in enumerate(ex.messages) if m["role"] in ("user", "raw"))
    text, most = ex.messages[i]["content"], room * per_token
    if len(text) <= most:  # (characters <= bytes)
        return ex, False
    messages = [dict(m) for m in ex.messages]
    messages[i]["content"] = text[: most // 2] + ELLIPSIS + text[len(text) - most // 2 :]
    return dataclasses.replace(ex, messages=messages), True


def fit_prompts(task: Task, tokenizer, context: int | None, budget: int, mode: str, warn: bool = True,
                advice: str = "shorten it, or set long_prompts: truncate") -> int:
    """Check every prompt of ``task`` (its ``prompt_pools``) against ``context`` minus
    the response ``budget``. mode ``error``: raise ConfigError naming the first prompt that does not
    fit; ``truncate``: cut those prompts in place, with a warning each. Returns how many were cut.
    A prompt's text is bounded by characters before it is tokenized (:func:`longest_token_bytes`): one whose
    bytes alone need more tokens than the room is refused, or cut, without tokenizing it whole."""
    pools = task.prompt_pools()
    if context is None or not pools:
        return 0
    room = context - budget
    if room < 1:
        raise ConfigError(f"the response budget of {budget} tokens leaves no room for a prompt in the model's "
                          f"context of {context} (max_position_embeddings)")
    cut, per_token = 0, longest_token_bytes(tokenizer)
    for pool in pools:
        for i, ex in enumerate(pool):
            where = ex.meta.get("source") or ex.id
            size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in ex.messages)
            if size > room * per_token and mode != "truncate":  # at least size / per_token tokens: no need to count
                raise ConfigError(f"{where}: the prompt has {size:,} bytes, at least {size // per_token:,} tokens, and "
                                  f"with the response budget of {budget} it does not fit the model's context of "
                                  f"{context}; {advice}")
            ex, bounded = _bounded(ex, room, per_token)
            n = len(format_prompt(tokenizer, ex.messages))
            if n <= room and not bounded:
                continue
            fitted = (ex if n <= room else _truncated(tokenizer, ex, room)) if mode == "truncate" else None
            if fitted is None:
                raise ConfigError(f"{where}: the prompt has {n} tokens, and with the response budget of {budget} "
                                  f"it does not fit the model's context of {context}; {advice}")
            pool[i] = fitted
            cut += 1
            if warn:
                was = f"{size:,} bytes" if bounded else f"{n} tokens"
                print(f"emapg: warning: {where}: prompt of {was} cut to fit the model's context of {context} "
                      f"(response budget {budget})", file=sys.stderr)
    return cut


def longest_prompt(task: Task, tokenizer, sample: int = 64) -> int:
    """The longest prompt, in tokens, a run's training rollouts can give: a task that reads files is measured
    whole; a generated one on ``sample`` training prompts, with half again as margin."""
    pools = task.prompt_pools()
    if pools:
        return max((len(format_prompt(tokenizer, ex.messages)) for pool in pools for ex in pool), default=0)
    drawn = draw_examples(task, random.Random(0), sample)
    return math.ceil(1.5 * max((len(format_prompt(tokenizer, ex.messages)) for ex in drawn), default=0))


def engine_model_len(task: Task, tokenizer, context: int | None, budget: int, sample: int = 64) -> int:
    """The longest prompt + response a run's training rollouts can make (:func:`longest_prompt`), for an
    engine that plans its cache by it (held-out evaluation samples with the HF backend). Rounded up to 64
    tokens, never past the model's ``context``."""
    total = 64 * math.ceil((longest_prompt(task, tokenizer, sample) + budget) / 64)
    return min(total, context) if context else total
