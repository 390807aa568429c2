"""Math answer checking with math-verify: is a model's final answer equivalent to the gold one?

The completion's answer is its last ``\\boxed{...}`` when there is one, else whatever math-verify
extracts (a final LaTeX expression or number). Equivalence is symbolic and numeric (fractions vs
decimals, intervals, tuples, sets, units stripped). Model text is parsed, never executed, and its work is
bounded per completion (measured in ``bench/grader_bounds.py``):

- an answer is parsed within :data:`PARSE_SECONDS` (answers parse in milliseconds; a 35,000-item tuple took
  minutes), and a boxed answer longer than :data:`LONG_ANSWER` characters and twice the gold's length is
  compared as text only, not parsed;
- a parsed form whose exact numbers would exceed :data:`emapg.rewards.magnitude.DIGITS_LIMIT` digits
  (``99999999!``, ``10^{10^{10}}``) is compared as text only, never computed;
- below that bound a number is read whole: while it grades, the grader raises Python's limit on the digits read
  into an int (4,300 by default, a process-wide setting) to :data:`~emapg.rewards.magnitude.DIGITS_LIMIT`;
- math-verify bounds each comparison at ``timeout`` seconds.
"""

from __future__ import annotations

import logging
import re
import sys
import threading

from emapg.rewards.magnitude import DIGITS_LIMIT, too_large

PARSE_SECONDS = 1
LONG_ANSWER = 500
logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeout warnings print the whole completion
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")


def closing_brace(text: str, start: int, depth: int = 0) -> int | None:
    """The index where the braces counted from ``start`` (``depth`` already open) close again, or None."""
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def brace_pairs(text: str) -> dict[int, int]:
    """Each ``{`` that closes, by its index, to the index of its ``}``: one pass with a stack (linear in the
    text, whatever a model writes; a runaway completion of 10,000 unclosed ``\\boxed{`` costs one scan)."""
    pairs, open_at = {}, []
    for i, ch in enumerate(text):
        if ch == "{":
            open_at.append(i)
        elif ch == "}" and open_at:
            pairs[open_at.pop()] = i
    return pairs


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    pairs = brace_pairs(text)
    for start in reversed(starts):
        end = pairs.get(start - 1)
        if end is not None:
            return text[start:end]
    return None


def _normalise_number_text(s: str) -> str:
    s = s.strip().strip("$").strip()
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s):
        s = _THOUSANDS.sub("", s)  # 1,000 -> 1000 (a list "1,2" has no 3-digit group and is kept)
        s = re.sub(r"^(-?)0+(?=\d)", r"\1", s)  # 025 -> 25
    return s


def _parse(text: str, timeout: int | None) -> list:
    """math-verify's forms of a text (a sympy expression and its string), the sympy ones dropped where their
    numbers are too large to compute (the string forms still compare)."""
    from math_verify import parse  # (optional: emapg[math])

    return [form for form in parse(text, parsing_timeout=timeout) if isinstance(form, str) or not too_large(form)]


def math_reward(completion: str, answer: str, timeout: int = 5) -> float:
    """1.0 if the completion's final answer is mathematically equal to ``answer``, else 0.0.

    ``timeout`` (seconds) bounds math-verify's parsing and comparison in the main thread; math-verify times
    out with ``signal.alarm``, which only the main thread may use, so elsewhere (a reward in a worker
    thread, as TRL or a web server may call it) they run without a limit."""
    from math_verify import verify  # (optional: emapg[math])

    if threading.current_thread() is not threading.main_thread():
        timeout = None
    limit = sys.get_int_max_str_digits()
    if 0 < limit < DIGITS_LIMIT:
        # Python reads at most 4,300 digits into an int by default, so sympy's parse failed on a 4,400-digit
        # answer written otherwise than its gold (unboxed, N.0): as many digits as the grader's bound, while it
        # grades (a process-wide setting: given back after, so a server beside it keeps Python's own limit)
        sys.set_int_max_str_digits(DIGITS_LIMIT)
        try:
            return math_reward(completion, answer, timeout)
        finally:
            sys.set_int_max_str_digits(limit)
    gold_text = _normalise_number_text(str(answer))
    boxed = last_boxed(completion)
    if boxed is not None and gold_text.strip() and _normalise_number_text(boxed).strip() == gold_text.strip():
        return 1.0  # the gold itself, written out: equal whatever sympy can read (an integer of 4,300+ digits not)
    gold = _parse(f"${gold_text}$", timeout) or _parse(gold_text, timeout)
    if not gold:
        return 0.0
    if boxed is not None and len(boxed) > max(LONG_ANSWER, 2 * len(gold_text)):
        pred = [_normalise_number_text(boxed)]  # compared with the gold's string form
    else:
        pred_text = f"${_normalise_number_text(boxed)}$" if boxed is not None else completion
        pred = _parse(pred_text, timeout and min(timeout, PARSE_SECONDS))
    if not pred:
        return 0.0
    try:
        return float(verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # a malformed expression is a wrong answer, not a crash
        return 0.0


def boxed_format_reward(completion: str) -> float:
    """1.0 if the completion puts a final answer in ``\\boxed{}``."""
    return float(last_boxed(completion) is not None)
