"""Procedurally generated arithmetic: "What is 23 + 45? Reply with just the number."

Difficulty is set by ``digits`` (operand size), ``ops`` (a subset of ``+-*``) and ``terms``
(chain length). The held-out set comes from a fixed seed and never overlaps training prompts:
training draws re-draw any problem whose text is in the held-out set.
"""

from __future__ import annotations

import random
import re

from emapg.settings import at_least
from emapg.tasks.base import Example, Task

_INT = re.compile(r"-?\d[\d,]*")
EVAL_SEED = 1_000_003


def parse_last_integer(text: str) -> int | None:
    """The last integer in ``text`` (commas as thousands separators allowed), or None."""
    found = _INT.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


class ArithmeticTask(Task):
    """Args: digits (operand size), ops (a subset of ``+-*``), terms (operands per problem), eval_size (the
    held-out problems, at most a fifth of the distinct ones), instruction (the text after the question)."""

    name = "arithmetic"
    ARGS = {"digits": at_least(1), "terms": at_least(2), "eval_size": at_least(1),
            "ops": ((lambda v: bool(v) and not set(v) - set("+-*")), "expected a non-empty subset of '+-*'")}

    def __init__(self, digits: int = 2, ops: str = "+", terms: int = 2, eval_size: int = 500,
                 instruction: str = "Reply with just the number."):
        self.digits, self.ops, self.terms, self.instruction = digits, ops, terms, instruction
        lo = 10 ** (digits - 1) if digits > 1 else 0
        space = (10**digits - lo) ** terms * len(set(ops)) ** (terms - 1)
        # Hold out at most a fifth of the distinct problems, so training always has fresh ones.
        self._eval = self._draw(random.Random(EVAL_SEED), min(eval_size, space // 5), exclude=set(), prefix="eval",
                                unique=True)
        self._eval_texts = {e.meta["expression"] for e in self._eval}

    def _problem(self, rng: random.Random) -> tuple[str, int]:
        lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits - 1
        nums = [rng.randint(lo, hi) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        expr = str(nums[0]) + "".join(f" {o} {n}" for o, n in zip(ops, nums[1:], strict=True))
        # Python's integer arithmetic on our own generated string of digits and + - * (never model text).
        stack = [nums[0]]
        for o, n in zip(ops, nums[1:], strict=True):
            if o == "*":
                stack[-1] *= n
            else:
                stack.append(n if o == "+" else -n)
        return expr, sum(stack)

    def _draw(self, rng: random.Random, n: int, exclude: set[str], prefix: str, unique: bool = False) -> list[Example]:
        out: list[Example] = []
        seen = set(exclude)
        while len(out) < n:
            expr, value = self._problem(rng)
            if expr in seen:
                continue
            if unique:
                seen.add(expr)
            msg = f"What is {expr}? {self.instruction}".strip()
            out.append(Example(id=f"{prefix}-{len(out)}", messages=[{"role": "user", "content": msg}],
                               answer=value, meta={"expression": expr}))
        return out

    def train_examples(self, rng: random.Random, n: int) -> list[Example]:
        return self._draw(rng, n, exclude=self._eval_texts, prefix="train")

    def eval_examples(self, size: int) -> list[Example]:
        """The first ``size`` of the held-out set (all of it when it has fewer, as a data file's task gives;
        ``task_args.eval_size`` sets its size)."""
        return self._eval[:size]

    def reward(self, completion: str, example: Example) -> float:
        return float(parse_last_integer(completion) == example.answer)
