"""The paper's math grader: the rules of the reference code's reward (rLLM's ``RewardMathFn`` over its
``math_utils``, which join Hendrycks' MATH normalisation and PRM800K's sympy check), written here from
reading it (LunjunZhang/ema-pg at f9b9776, math/rllm/rewards/). ``task_args.grader: reference`` uses it;
``lenient`` (:mod:`emapg.rewards.math`, math-verify) is emapg's own.

The rules, in order:

1. **What is graded** (rLLM's MathAgent, then the reward): with exactly one ``</think>`` the text after it;
   with none the whole response; with two or more the text between the first and the second.
2. **The answer**: the last ``\\boxed`` of that text (``rfind``), its braces matched; it must read
   ``\\boxed{...}`` exactly (``\\boxed 5`` or ``\\boxed {5}`` give none), GLM's ``<|begin_of_box|>`` markers
   first. No answer scores 0 (``\\fbox`` alone too: the reward asks for ``\\boxed``).
3. **The gold**: a list's items are alternatives (any one scores 1; OlympiadBench's ``final_answer``); a gold
   holding ``\\boxed`` is its boxed content.
4. **Equal** when the MATH normalisations are equal strings (:func:`mathd_normalize`), or PRM800K's
   normalisations are (:func:`normalize`), or, element by element of a tuple or interval (brackets that must
   match), fractions as equal strings, integers against integers, the rest by ``sympy.simplify(a - b) == 0``
   when the expression is safe to evaluate (:func:`sympy_equal`).
5. **Truncated** responses score 0 (rLLM's engine resets the reward of a response that ran out of tokens),
   which the caller applies (:func:`emapg.tasks.base.score_completions`).

Ours alone: an answer whose exact numbers would exceed 10,000 digits (``99999999!``, ``9**9**9``: the reference
computes them for minutes or hours, or until memory runs out) is not equal, decided from its unevaluated parse
(:mod:`emapg.rewards.magnitude`); and sympy's simplification is bounded in time in the main thread (5 s, then not
equal) so that no answer hangs training; the reference has no bound. sympy's parser evaluates the normalised
answer in sympy's namespace, as the reference does, and only where the reference deems it safe: at most two
distinct letters (no import, no builtin call can be spelled), no braced or large exponent.
"""

from __future__ import annotations

import logging
import re
import signal
import threading

from emapg.rewards.magnitude import too_large
from emapg.rewards.math import closing_brace

THINK_END = "</think>"
UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
         "foot", "feet", "inch", "yard")
TUPLE_CHARS = "()[]"
_LEADING_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}")
_BOX_MARKERS = re.compile(r"<\|begin_of_box\|>([\s\S]*?)<\|end_of_box\|>")
_GROUPED_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile("([0-9]) +([0-9])")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_UNSAFE = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
logging.getLogger("pylatexenc").setLevel(logging.ERROR)  # a warning per malformed macro: 14,000 for a runaway


# ---- the answer ---------------------------------------------------------------------------------------

def graded_text(response: str) -> str:
    """The part of a response the reference grades (rule 1)."""
    if response.count(THINK_END) == 1:
        return response.partition(THINK_END)[2].strip()
    response = response.strip()
    return response.split(THINK_END)[1] if THINK_END in response else response


def last_boxed(text: str) -> str | None:
    """The content of the text's last ``\\boxed`` when it reads ``\\boxed{...}`` (braces matched), else None."""
    start = text.rfind("\\boxed")
    end = closing_brace(text, start) if start >= 0 else None
    if end is None or not text.startswith("\\boxed{", start):
        return None
    return text[start + len("\\boxed{") : end]


def extract_answer(text: str) -> str | None:
    """The answer of a graded text (rule 2): the last box marker's content, else the last ``\\boxed{}``'s."""
    if "<|begin_of_box|>" in text and "<|end_of_box|>" in text:
        found = _BOX_MARKERS.findall(text)
        if found:
            return found[-1].strip()
    return last_boxed(text) if "\\boxed" in text else None


def gold_forms(gold) -> list[str]:
    """The gold's accepted forms (rule 3)."""
    items = [gold] if isinstance(gold, str | float | int) else list(gold)
    out = []
    for item in map(str, items):
        if "\\boxed" in item:
            item = extract_answer(item)
        if item is not None:
            out.append(item)
    return out


# ---- MATH's normalisation ---------------------------------------------------------------------------

def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}`` (a ``\\frac`` with fewer than two
    characters after it leaves the string as it was)."""
    parts = s.split("\\frac")
    out = parts[0]
    for rest in parts[1:]:
        out += "\\frac"
        if not rest:
            raise IndexError("\\frac at the end")  # the reference fails here: the answer stays unnormalised
        if rest.startswith("{"):
            out += rest
        elif len(rest) < 2:
            return s
        elif rest[1] != "{":
            out += "{" + rest[0] + "}{" + rest[1] + "}" + rest[2:]
        else:
            out += "{" + rest[0] + "}" + rest[1:]
    return out


def _slash_to_frac(s: str) -> str:
    """``3/4`` (two integers written plainly) -> ``\\frac{3}{4}``."""
    a, sep, b = s.partition("/")
    if not sep or "/" in b:
        return s
    try:
        if s == f"{int(a)}/{int(b)}":
            return f"\\frac{{{int(a)}}}{{{int(b)}}}"
    except ValueError:
        pass
    return s


def _braced_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    if not all(parts[1:]):
        raise IndexError("\\sqrt at the end")  # the reference fails here: the answer stays unnormalised
    return parts[0] + "".join("\\sqrt" + (p if p.startswith("{") else "{" + p[:1] + "}" + p[1:]) for p in parts[1:])


def _strip_math(s: str) -> str:
    """Hendrycks' MATH string normalisation."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # units written after the number: "5 \text{ cm}" -> "5 "
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError("more than one unit")
        s = parts[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5", "k=5" -> "5"
        s = sides[1]
    s = _braced_fracs(_braced_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def mathd_normalize(answer: str) -> str:
    """MATH's normal form of an answer: a leading ``\\text{...}`` unwrapped, then :func:`_strip_math` (an answer
    it cannot normalise stays as given, stripped)."""
    answer = answer.strip()
    try:
        m = _LEADING_TEXT.search(answer)
        if m is not None:
            answer = m.group("text").strip()
        return _strip_math(answer)
    except Exception:
        return answer


# ---- PRM800K's normalisation and sympy check ----------------------------------------------------------

def _ungroup_thousands(s: str) -> str:
    """``1,000,000`` -> ``1000000`` (commas between three-digit groups only)."""
    while True:
        done = _GROUPED_THOUSANDS.sub(r"\1\3\4", s)
        if done == s:
            return done
        s = done


def _is_int_text(s: str) -> bool:
    try:
        x = float(_ungroup_thousands(s))
    except (ValueError, OverflowError):
        return False
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _latex_to_text(s: str) -> str:
    from pylatexenc.latex2text import LatexNodes2Text  # (optional: emapg[math])

    s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    s = LatexNodes2Text().latex_to_text(s)
    for old, new in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        s = s.replace(old, new)
    return s.strip()


def normalize(expr: str) -> str:
    """PRM800K's normal form of an answer: text, dollars, percent signs, units and degrees removed, ``or`` /
    ``and`` as commas, LaTeX read as text, spaces and braces removed, lower case, integers written plainly."""
    m = _LEADING_TEXT.search(expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    try:
        if abs(float(expr) - int(round(float(expr)))) <= 1e-7:
            expr = str(int(round(float(expr))))
    except (ValueError, OverflowError):
        pass
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:
            pass
    expr = _MIXED_NUMBER.sub(r"\1+\2", re.sub("- *", "-", expr))  # "7 3/4" -> "7+3/4"
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_int_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval written with one pair of brackets, else the expression alone."""
    expr = _ungroup_thousands(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    bracketed = expr[0] in TUPLE_CHARS and expr[-1] in TUPLE_CHARS
    if len(expr) > 2 and bracketed and not any(c in inner for c in TUPLE_CHARS):
        return [e.strip() for e in inner.split(",")]
    return [expr]


def _safe_to_evaluate(expr: str) -> bool:
    """At most two distinct letters (sqrt and frac aside), no braced or parenthesised exponent, no exponent of
    two digits or more, no stacked exponents: what sympy simplifies quickly."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return len(letters) <= 2 and "^{" not in expr and "^(" not in expr and not any(r.search(expr) for r in _UNSAFE)


def _parsed(expr: str, evaluate: bool = True):
    """The reference's sympy parse of a normalised difference; unevaluated, with factorials left unevaluated too
    (sympy's parser computes ``99999999!`` as it reads it), for :func:`emapg.rewards.magnitude.too_large`."""
    import sympy  # (heavy, ~0.5 s: only when an answer needs it)
    from sympy.parsing import sympy_parser  # (heavy: as sympy)

    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    if evaluate:
        return sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)
    held = {"factorial": lambda n: sympy.factorial(n, evaluate=False),
            "factorial2": lambda n: sympy.factorial2(n, evaluate=False)}
    return sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations, local_dict=held,
                                   evaluate=False)


def sympy_equal(gold: str, given: str, timeout: int = 5) -> bool:
    """``simplify(gold - given) == 0`` for normalised elements, when safe to evaluate; not equal, without
    computing, when its numbers would exceed :data:`~emapg.rewards.magnitude.DIGITS_LIMIT` digits; bounded in
    time in the main thread (then: not equal)."""
    expr = f"({gold})-({given})"
    if not _safe_to_evaluate(expr):
        return False
    import sympy  # (heavy, ~0.5 s: only when an answer needs it)

    def check() -> bool:
        unevaluated = None
        if any(op in expr for op in ("^", "**", "!")):  # only powers and factorials reach past the bound here
            try:
                unevaluated = _parsed(expr, evaluate=False)
            except Exception:  # the reference's parse alone decides
                pass
        if unevaluated is not None and too_large(unevaluated):
            return False
        return sympy.simplify(_parsed(expr)) == 0

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        try:
            return bool(check())
        except Exception:
            return False

    def stop(signum, frame):
        raise TimeoutError

    before = signal.signal(signal.SIGALRM, stop)
    signal.alarm(timeout)
    try:
        return bool(check())
    except Exception:  # a parse error, sympy's own errors, the time bound: not equal
        return False
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def sympy_grade(given: str, gold: str) -> bool:
    """PRM800K's check (rule 4 after the MATH string test)."""
    g, a = normalize(gold), normalize(given)
    if g == a:
        return True
    if not a:
        return False
    g_elems, a_elems = split_tuple(g), split_tuple(a)
    if len(g_elems) > 1 and (g[0] != a[0] or g[-1] != a[-1]):  # (1,2) is not [1,2]
        return False
    if len(g_elems) != len(a_elems):
        return False
    for ge, ae in zip(g_elems, a_elems, strict=True):
        if _FRACTION.search(ge) and _FRACTION.search(ae):
            ok = ge == ae
        elif _is_int_text(ge) != _is_int_text(ae):
            ok = False
        else:
            ok = sympy_equal(ge, ae)
        if not ok:
            return False
    return True


def reference_math_reward(response: str, gold) -> float:
    """1.0 when the response's answer equals one of the gold's forms by the reference's rules, else 0.0
    (no answer, a wrong one, an empty response). Truncation is the caller's (rule 5)."""
    if not response:
        return 0.0
    answer = extract_answer(graded_text(response))
    if answer is None:
        return 0.0
    for form in gold_forms(gold):
        if mathd_normalize(answer) == mathd_normalize(form) or sympy_grade(answer, form):
            return 1.0
    return 0.0
