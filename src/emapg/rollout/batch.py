"""RolloutBatch: the one record that travels through a training step (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


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
