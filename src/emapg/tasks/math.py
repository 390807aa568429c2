"""Math reasoning from data files: prompts from a problem column, reward = answer equivalence.

Templates (``template``):
  r1     the R1-distill user prompt: the problem, then "Please reason step by step, and put your
         final answer within \\boxed{}." in a chat turn (the paper's math setup);
  chat   the problem alone in a chat turn;
  plain  for base models without a chat template: "Problem: ...\\nSolution:" as raw text.
"""

from __future__ import annotations

import random

from emapg.data import load_rows
from emapg.rewards.math import boxed_format_reward, math_reward
from emapg.tasks.base import Example, Task

R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("r1", "chat", "plain")


def format_messages(problem: str, template: str) -> list[dict[str, str]]:
    if template == "r1":
        return [{"role": "user", "content": f"{problem}\n{R1_INSTRUCTION}"}]
    if template == "chat":
        return [{"role": "user", "content": problem}]
    if template == "plain":  # the 'raw' role is sent as text without a chat template
        return [{"role": "raw", "content": f"Problem: {problem}\nSolution:"}]
    raise ValueError(f"task_args.template: expected one of {', '.join(TEMPLATES)}, got {template!r}")


class MathTask(Task):
    """Args:
        train_file: prompts for training (JSONL/JSON/Parquet/datasets folder), or None for eval only.
        eval_file: held-out problems (default: the training file's last ``eval_size`` rows are not
            used for training then).
        problem_field, answer_field: column names in the files.
        template: r1, chat or plain. format_weight: add this times the boxed-format reward.
    """

    name = "math"

    def __init__(self, train_file: str | None = None, eval_file: str | None = None, problem_field: str = "problem",
                 answer_field: str = "answer", template: str = "r1", format_weight: float = 0.0,
                 eval_size: int = 500):
        if train_file is None and eval_file is None:
            raise ValueError("task_args: the math task needs train_file and/or eval_file")
        format_messages("", template)
        self.template, self.format_weight = template, format_weight
        fields = {"problem": problem_field, "answer": answer_field}
        train = load_rows(train_file, fields, ("problem", "answer")) if train_file else []
        held = load_rows(eval_file, fields, ("problem", "answer")) if eval_file else []
        if not held:
            held, train = train[-eval_size:], train[:-eval_size]
        self._train = [self._example(r, "train") for r in train]
        self._eval = [self._example(r, "eval") for r in held]

    def _example(self, row: dict, prefix: str) -> Example:
        return Example(id=f"{prefix}-{row['id']}", messages=format_messages(str(row["problem"]), self.template),
                       answer=str(row["answer"]), meta={"problem": row["problem"], "source": row.get("_source")})

    def train_examples(self, rng: random.Random, n: int) -> list[Example]:
        if not self._train:
            raise ValueError("task_args.train_file: the math task has no training rows")
        return [self._train[rng.randrange(len(self._train))] for _ in range(n)]

    def eval_examples(self, size: int) -> list[Example]:
        return self._eval[:size]

    def prompt_pools(self) -> list[list[Example]]:
        """Every example this task can hand out (training, held-out), for checks before training."""
        return [self._train, self._eval]

    def eval_reward(self, completion: str, example: Example) -> float:
        """Correctness alone (held-out accuracy): no format bonus."""
        return math_reward(completion, example.answer)

    def reward(self, completion: str, example: Example) -> float:
        score = math_reward(completion, example.answer)
        if self.format_weight:
            score += self.format_weight * boxed_format_reward(completion)
        return score
