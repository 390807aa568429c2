"""Question-answering rewards: SQuAD-style normalised exact match and token F1."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (the SQuAD evaluation script)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def qa_em(prediction: str, answers: list[str] | str) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer."""
    golds = [answers] if isinstance(answers, str) else answers
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def qa_f1(prediction: str, answers: list[str] | str) -> float:
    """Best token-level F1 between the normalised prediction and any gold answer."""
    golds = [answers] if isinstance(answers, str) else answers
    pred = normalize_answer(prediction).split()
    best = 0.0
    for g in golds:
        gold = normalize_answer(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        if common:
            p, r = common / len(pred), common / len(gold)
            best = max(best, 2 * p * r / (p + r))
    return best
