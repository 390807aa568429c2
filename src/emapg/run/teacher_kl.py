"""A distillation run's closeness to its teacher, measured exactly and without sampling noise.

The endpoint: the student's reverse KL to the teacher, ``KL(pi_student || pi_teacher)`` summed over the whole
vocabulary at every position of *fixed* responses, averaged over their tokens. The responses are the
teacher's own greedy answers to the held-out prompts, made once per run (the same for every run with that
teacher and set, whatever is being compared), so two runs are measured on the same positions and the
number moves only with the student's weights. Both models are read at the loss's temperature
(``rollout.temperature``), as the KL term of the loss reads them.

Held-out accuracy is a count of right answers, which moves in whole problems and differs seed to seed by
several points; this is the quantity on-policy distillation lowers, as a continuous mean over thousands
of positions (docs/RESULTS.md, "On-policy distillation").
"""

from __future__ import annotations

import torch
from torch import nn

from emapg.kl import head_term
from emapg.models import distributed
from emapg.models.forward import response_hidden
from emapg.models.lm import decoder_and_head, head_logits, head_transform
from emapg.rollout import rollout_for_task
from emapg.rollout.sampling import RolloutBatch, SamplingSpec
from emapg.tasks.base import Example, Task


@torch.no_grad()
def teacher_responses(teacher: nn.Module, tokenizer, task: Task, examples: list[Example], max_new_tokens: int,
                      batch_size: int = 64) -> list[RolloutBatch]:
    """The teacher's greedy responses to ``examples``, in batches of ``batch_size`` prompts."""
    spec = SamplingSpec(n=1, greedy=True, max_new_tokens=max_new_tokens)
    return [rollout_for_task(teacher, tokenizer, task, examples[i : i + batch_size], spec)
            for i in range(0, len(examples), batch_size)]


@torch.no_grad()
def reverse_kl_sum(student: nn.Module, teacher: nn.Module, batch: RolloutBatch, temperature: float = 1.0,
                   chunk: int = 256) -> tuple[float, int]:
    """``sum over the batch's response tokens of KL(student || teacher)`` (exact over the vocabulary, in
    float64 from each model's logits) and the number of tokens; at most ``chunk`` positions' logits at once."""
    mask = batch.response_mask.bool()
    total, count = 0.0, int(mask.sum())
    hs, ht = response_hidden(student, batch)[mask], response_hidden(teacher, batch)[mask]
    (_, s_head), (_, t_head) = decoder_and_head(student), decoder_and_head(teacher)
    tf_s, tf_t = head_transform(student), head_transform(teacher)
    for i in range(0, count, chunk):
        zs = head_logits(hs[i : i + chunk], s_head.weight, s_head.bias, temperature, tf_s).double()
        zt = head_logits(ht[i : i + chunk], t_head.weight, t_head.bias, temperature, tf_t).double()
        ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
        total += float(head_term("reverse", ls, lt).sum())  # the head over the whole vocabulary: the exact KL
    return total, count


class TeacherKL:
    """A run's teacher-KL evaluations: the fixed responses made at the first call, then the student's exact
    reverse KL to the teacher on them. Each process measures its share of the held-out problems (every
    ``world``-th) and the sums are combined (collective when ``world > 1``)."""

    def __init__(self, teacher: nn.Module, tokenizer, task: Task, examples: list[Example], max_new_tokens: int,
                 temperature: float, rank: int = 0, world: int = 1):
        self.teacher, self.tokenizer, self.task = teacher, tokenizer, task
        self.examples = examples[rank::world]
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.batches: list[RolloutBatch] | None = None

    def __call__(self, student: nn.Module) -> float:
        """The mean per token of KL(student || teacher) on the teacher's held-out responses."""
        with distributed.gathered(self.teacher) as teacher:
            if self.batches is None:
                self.batches = teacher_responses(teacher, self.tokenizer, self.task, self.examples,
                                                 self.max_new_tokens)
            parts = [reverse_kl_sum(student, teacher, b, self.temperature) for b in self.batches]
        total, count = distributed.all_reduce([sum(p[0] for p in parts), float(sum(p[1] for p in parts))])
        return total / max(count, 1.0)
