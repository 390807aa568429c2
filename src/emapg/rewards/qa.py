"""Question-answering rewards: SQuAD-style normalised exact match and token F1."""

from __future__ import annotations

import re
import string
from collections import Counter

from emapg.data import DataError, answer_text

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (the SQuAD evaluation script)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def qa_em(prediction: str, answers: list[str] | str) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer. A prediction that normalises to
    nothing (empty, or only articles and punctuation) matches no gold, even one that normalises to nothing
    ("the"): an empty ``<answer> </answer>`` earns no credit."""
    golds = [answers] if isinstance(answers, str) else answers
    pred = normalize_answer(prediction)
    return float(bool(pred) and any(pred == normalize_answer(g) for g in golds))


def qa_f1(prediction: str, answers: list[str] | str) -> float:
    """Best token-level F1 between the normalised prediction and any gold answer."""
    golds = [answers] if isinstance(answers, str) else answers
    pred = normalize_answer(prediction).split()
    best = 0.0
    for g in golds:
        gold = normalize_answer(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold:  # nothing to match: no credit (an empty answer matches no gold)
            continue
        if common:
            p, r = common / len(pred), common / len(gold)
            best = max(best, 2 * p * r / (p + r))
    return best


def gold_answers(value: object, where: str) -> list[str]:
    """A row's gold answers as a list of strings (a string or a number alone is one answer), refusing what no
    prediction could match: no answers, a null, a non-text item, or only answers that normalise to nothing.
    Answers that normalise to nothing beside others are dropped. Errors name ``where`` (file, line, field)."""
    items = value if isinstance(value, list | tuple) else [value]
    out = [answer_text(item, where) for item in items]
    if not out:
        raise DataError(f"{where}: no gold answers (an empty list): no prediction could be scored right")
    kept = [a for a in out if normalize_answer(a)]
    if not kept:
        raise DataError(f"{where}: every gold answer ({', '.join(map(repr, out))}) normalises to nothing (articles "
                        "and punctuation are dropped): no prediction could match it")
    return kept
