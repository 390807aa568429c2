"""Math reasoning from data files: prompts from a problem column, reward = answer equivalence.

Templates (``template``):
  r1     the R1-distill user prompt: the problem, then "Please reason step by step, and put your
         final answer within \\boxed{}." in a chat turn (the paper's math setup);
  chat   the problem alone in a chat turn;
  plain  for base models without a chat template: "Problem: ...\\nSolution:" as raw text.
"""

from __future__ import annotations

import random
import re
import sys

from emapg.data import DataError, answer_text, check_text, load_rows
from emapg.errors import ConfigError
from emapg.rewards.math import boxed_format_reward, math_reward
from emapg.rewards.math_reference import gold_forms, normalize, reference_math_reward
from emapg.settings import at_least, one_of
from emapg.tasks.base import Example, Task

R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("r1", "chat", "plain")
GRADERS = ("lenient", "reference")
# The published sets' column names, tried in order when the file has not the ones given (problem_field,
# answer_field): MATH-500, AIME 2024 (HuggingFaceH4/aime_2024), DeepScaleR's and rLLM's JSON: problem, answer;
# AIME 2024 (Maxwell-Jia/AIME_2024): Problem, Answer; AIME 2025 (opencompass/AIME2025), OlympiadBench
# (Hothan/OlympiadBench): question, with final_answer a list of LaTeX answers; AMC (AI-MO/aimo-validation-amc):
# answer a number (142.0).
PROBLEM_FIELDS = ("problem", "Problem", "question", "Question")
ANSWER_FIELDS = ("answer", "Answer", "final_answer", "ground_truth")


def gold_answers(value, together: bool = False, as_written: bool = False) -> list[str]:
    """A row's answer as the list of its accepted forms: a list (OlympiadBench's ``final_answer``, e.g.
    ``["$3$"]``) gives each, a whole float (AMC's 142.0) its integer; enclosing ``$...$`` are removed.
    ``together`` (OlympiadBench's ``is_multiple_answer``): the list's items are one answer, all of them,
    written as ``a, b``. ``as_written`` (the reference grader): each item exactly as the reference's reward
    reads it, ``str(item)`` (``$7$`` keeps its dollars, 142.0 stays ``142.0``), nothing stripped."""
    items = value if isinstance(value, list | tuple) else [value]
    if together and len(items) > 1:
        return [", ".join(gold_answers(items))]
    out = []
    for v in items:
        text = answer_text(v)  # (a null, a list or NaN is refused here either way)
        if as_written:
            out.append(str(v))
            continue
        text = text.strip()
        while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
            text = text[1:-1].strip()
        out.append(text)
    return out


_WRAPPING = re.compile(r"\\(?:boxed|text|mathrm|textbf|mbox)|[{}$\s]")


def gradable(golds: list[str], grader: str) -> bool:
    """Whether some answer could match one of ``golds`` under ``grader``: the reference's accepted forms (a closed
    ``\\boxed``) with a non-empty normal form, or for the lenient grader some text beside the LaTeX wrapping
    (a gold of ``\\boxed{}`` or ``\\text{}`` matched nothing, or an empty answer)."""
    if grader == "reference":
        return any(normalize(form) for form in gold_forms(golds))
    return any(_WRAPPING.sub("", gold) for gold in golds)


def math_rows(path: str, problem_field: str, answer_field: str, alternatives: bool = False) -> list[dict]:
    """Rows of a math file with ``problem`` and ``answer`` (a list of accepted forms): the columns named, or
    where the file has not them, the first of the published sets' names it has (:data:`PROBLEM_FIELDS`).
    ``alternatives`` (the reference grader's rules): a list answer's items are accepted forms even in a row marked
    ``is_multiple_answer``, each kept as written (:func:`gold_answers`); otherwise such a row's items are one
    answer, all of them."""
    rows = load_rows(path)
    for row in rows:
        columns = {}
        for name, given, known in (("problem", problem_field, PROBLEM_FIELDS), ("answer", answer_field, ANSWER_FIELDS)):
            column = given if given in row else next((k for k in known if k in row), None)
            if column is None:
                tried = ", ".join(dict.fromkeys((given, *known)))
                raise DataError(f"{row['_source']}: no {name} (looked for {tried}); the row has "
                                f"{', '.join(sorted(k for k in row if not k.startswith('_')))}")
            if row[column] is None:
                raise DataError(f"{row['_source']}: field {column!r} is null (expected the {name})")
            row[name], columns[name] = row[column], column
        if not isinstance(row["problem"], str):
            raise DataError(f"{row['_source']}: field {columns['problem']!r} is {type(row['problem']).__name__}, "
                            "expected text")
        try:
            row["answer"] = gold_answers(row["answer"], as_written=alternatives,
                                         together=row.get("is_multiple_answer") is True and not alternatives)
        except DataError as e:
            raise DataError(f"{row['_source']}: field {columns['answer']!r}: {e}") from None
        if not row["answer"] or not (alternatives or all(row["answer"])):  # the reference loads an empty one
            raise DataError(f"{row['_source']}: field {columns['answer']!r}: an empty answer")
        check_text([row["problem"], *row["answer"]], f"{row['_source']}: field {columns['problem']!r} or "
                                                     f"{columns['answer']!r}")
    return rows


def format_messages(problem: str, template: str) -> list[dict[str, str]]:
    if template == "r1":
        return [{"role": "user", "content": f"{problem}\n{R1_INSTRUCTION}"}]
    if template == "chat":
        return [{"role": "user", "content": problem}]
    if template == "plain":  # the 'raw' role is sent as text without a chat template
        return [{"role": "raw", "content": f"Problem: {problem}\nSolution:"}]
    raise ConfigError(f"task_args.template: expected one of {', '.join(TEMPLATES)}, got {template!r}")


class MathTask(Task):
    """Args:
        train_file: prompts for training (JSONL/JSON/Parquet/datasets folder), or None for eval only.
        eval_file: held-out problems (default: the training file's last ``eval_size`` rows are not
            used for training then).
        problem_field, answer_field: column names in the files.
        template: r1, chat or plain. format_weight: add this times the boxed-format reward.
        grader: ``lenient`` (math-verify: the last boxed answer, else a final expression, anywhere in the
            response) or ``reference`` (the paper's code's rules, :mod:`emapg.rewards.math_reference`: the answer
            after ``</think>``, a ``\boxed{}`` required, a list's items as alternatives, a truncated response 0).
    """

    name = "math"
    ARGS = {"template": one_of(TEMPLATES), "format_weight": at_least(0, finite=True), "eval_size": at_least(1),
            "grader": one_of(GRADERS)}

    def __init__(self, train_file: str | None = None, eval_file: str | None = None, problem_field: str = "problem",
                 answer_field: str = "answer", template: str = "r1", format_weight: float = 0.0,
                 eval_size: int = 500, grader: str = "lenient"):
        if train_file is None and eval_file is None:
            raise ConfigError("task_args: the math task needs train_file and/or eval_file")
        self.template, self.format_weight, self.grader = template, format_weight, grader
        self.zero_truncated = grader == "reference"
        alternatives = grader == "reference"
        train = math_rows(train_file, problem_field, answer_field, alternatives) if train_file else []
        held = math_rows(eval_file, problem_field, answer_field, alternatives) if eval_file else []
        never = [row for row in (*train, *held) if not gradable(row["answer"], grader)]
        if never and grader != "reference":
            row = never[0]
            raise DataError(f"{row['_source']}: the answer {row['answer']!r} has nothing the {grader} grader can "
                            "match (it normalises to nothing, or its \\boxed is not closed): fix or drop the row")
        if never:  # the reference loads such a row and grades it as it does every other: kept, and said
            print(f"emapg: warning: {len(never)} row(s) whose answer the reference grader reads as nothing (no "
                  "closed \\boxed, or a form that normalises to nothing): kept and graded by its rules, as the "
                  "reference keeps them, so no answer scores on them but an empty one (such as \\boxed{}) on a "
                  f"gold that normalises to nothing; e.g. {never[0]['_source']}: {never[0]['answer']!r}",
                  file=sys.stderr)
        if not held:
            if train and len(train) <= eval_size:
                raise ConfigError(f"task_args.train_file: {train_file} has {len(train)} rows, and without an eval_file "
                                 f"its last eval_size ({eval_size}) are held out, which leaves none to train on: give "
                                 "an eval_file, or a smaller task_args.eval_size")
            held, train = train[-eval_size:], train[:-eval_size]
        self._train = [self._example(r, "train") for r in train]
        self._eval = [self._example(r, "eval") for r in held]

    def _example(self, row: dict, prefix: str) -> Example:
        answer = row["answer"] if len(row["answer"]) > 1 else row["answer"][0]
        return Example(id=f"{prefix}-{row['id']}", messages=format_messages(str(row["problem"]), self.template),
                       answer=answer, meta={"problem": row["problem"], "source": row.get("_source"),
                                            "data_source": row.get("data_source")})

    def train_examples(self, rng: random.Random, n: int) -> list[Example]:
        if not self._train:
            raise ConfigError("task_args.train_file: the math task has no training rows")
        return [self._train[rng.randrange(len(self._train))] for _ in range(n)]

    def eval_examples(self, size: int) -> list[Example]:
        return self._eval[:size]

    def train_pool(self) -> list[Example] | None:
        return self._train or None

    def prompt_pools(self) -> list[list[Example]]:
        """Every example this task can hand out (training, held-out), for checks before training."""
        return [self._train, self._eval]

    def eval_reward(self, completion: str, example: Example) -> float:
        """Correctness alone (held-out accuracy): no format bonus. A list answer: any of its forms."""
        golds = example.answer if isinstance(example.answer, list) else [example.answer]
        if self.grader == "reference":
            return reference_math_reward(completion, golds)
        return max(math_reward(completion, gold) for gold in golds)

    def reward(self, completion: str, example: Example) -> float:
        score = self.eval_reward(completion, example)
        if self.format_weight:
            score += self.format_weight * boxed_format_reward(completion)
        return score
