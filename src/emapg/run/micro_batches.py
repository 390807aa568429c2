"""How a process's share of a step is cut: mini-batches (one optimizer step each) of micro-batches (one
forward and backward each, gradients accumulating). By prompts (``micro_batch_prompts``: whole groups of
responses), or packed by tokens (``micro_batch_tokens``: verl's dynamic batch size,
``ppo_max_token_len_per_gpu``). The cut changes memory, never the gradient: the loss of a mini-batch is
normalised by its global counts, whatever its micro-batches (tests/test_micro_batches.py).

Packing keeps the rows in order (a prompt's rows that land together share its pass) and makes, on every
process, as many micro-batches as the process that needs the most: under FSDP2 each is a sequence of
collectives that all ranks must make alike. That one all-reduce is the only impure line here.
"""

from __future__ import annotations

from itertools import pairwise

from emapg.models import distributed
from emapg.rollout.batch import RolloutBatch


def step_micro_batches(batch: RolloutBatch, mini_prompts: int, micro_prompts: int,
                       micro_tokens: int = 0) -> list[list[RolloutBatch]]:
    """This process's rows of a step as mini-batches of ``mini_prompts`` prompts, each cut into micro-batches
    of ``micro_prompts`` prompts, or, with ``micro_tokens`` > 0, packed by tokens (:func:`cut_into`)."""
    if not micro_tokens:  # micro_prompts divides mini_prompts (config.check_world)
        mbs, per = batch.micro_batches(micro_prompts), mini_prompts // micro_prompts
        return [mbs[i : i + per] for i in range(0, len(mbs), per)]
    minis = [slice(s, s + mini_prompts) for s in range(0, batch.num_prompts, mini_prompts)]
    tokens = row_tokens(batch)
    rows = [batch.rows(m) for m in minis]
    fewest = [len(greedy_cuts(tokens[r], micro_tokens)) - 1 for r in rows]
    counts = [int(c) for c in distributed.all_reduce(fewest, op="max")]  # every rank makes as many
    out = []
    for r, parts in zip(rows, counts, strict=True):
        cuts = cut_into(tokens[r], parts, micro_tokens)
        out.append([batch.row_batch(slice(r.start + a, r.start + b)) for a, b in pairwise(cuts)])
    return out


def row_tokens(batch: RolloutBatch) -> list[int]:
    """Each row's tokens, as verl counts them against its budget: its prompt's and its response's up to the
    last token that counts (tool output before it is context the pass runs too)."""
    return (batch.per_row(batch.prompt_mask.sum(1)) + batch.extent()).tolist()


def greedy_cuts(tokens: list[int], budget: int) -> list[int]:
    """Boundaries [0, ..., len(tokens)] of the fewest consecutive runs of rows that each count at most
    ``budget`` tokens (a row over it alone): the greedy cut, which is the fewest for consecutive runs."""
    cuts, total = [0], 0
    for i, t in enumerate(tokens):
        if i > cuts[-1] and total + t > budget:
            cuts.append(i)
            total = 0
        total += t
    return [*cuts, len(tokens)]


def cut_into(tokens: list[int], parts: int, budget: int) -> list[int]:
    """Boundaries of exactly ``parts`` consecutive non-empty runs (1 <= parts <= rows, and at least the fewest
    :func:`greedy_cuts` makes): the greedy cut, whose runs are within ``budget``, then the run with the most
    tokens split where its two halves' tokens are closest, until there are ``parts``; every run stays within
    ``budget`` (or is one row)."""
    cuts = greedy_cuts(tokens, budget)
    if not len(cuts) - 1 <= parts <= len(tokens):
        raise ValueError(f"{parts} runs of {len(tokens)} rows: the greedy cut needs {len(cuts) - 1}")
    while len(cuts) - 1 < parts:
        _, a, b = max((sum(tokens[a:b]), a, b) for a, b in pairwise(cuts) if b - a > 1)
        middle = min(range(a + 1, b), key=lambda m: (abs(sum(tokens[a:m]) - sum(tokens[m:b])), m))
        cuts = sorted([*cuts, middle])
    return cuts
