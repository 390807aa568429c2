"""The graders' bound on the numbers of a model's answer (emapg.rewards.magnitude): an upper bound, checked against
the numbers sympy computes, that refuses a runaway answer without computing it, in both math graders."""

import math

import pytest
import sympy

from emapg.rewards import magnitude, math_reference
from emapg.rewards import math as lenient
from emapg.rewards.magnitude import DIGITS_LIMIT, digits_bound, too_large
from emapg.rewards.math import math_reward
from emapg.rewards.math_reference import reference_math_reward, sympy_equal


def _digits(value) -> float:
    """log10 of an exact number's largest part (numerator or denominator)."""
    value = sympy.Rational(value)
    return max(math.log10(abs(value.p)) if value.p else 0.0, math.log10(value.q))


def test_the_bound_is_above_every_power_and_factorial_sympy_computes():
    checked = 0
    for base in [*range(-12, 13), sympy.Rational(2, 3), sympy.Rational(-7, 5)]:
        for exponent in range(-6, 40):
            if base == 0 and exponent < 0:
                continue
            node = sympy.Pow(sympy.sympify(base), exponent, evaluate=False)
            assert digits_bound(node) >= _digits(sympy.Pow(base, exponent)) - 1e-9, (base, exponent)
            checked += 1
    for n in range(0, 400, 7):
        assert digits_bound(sympy.factorial(n, evaluate=False)) >= _digits(sympy.factorial(n)) - 1e-9
        assert digits_bound(sympy.binomial(n, n // 3, evaluate=False)) >= _digits(sympy.binomial(n, n // 3)) - 1e-9
        assert digits_bound(sympy.fibonacci(n, evaluate=False)) >= _digits(sympy.fibonacci(n)) - 1e-9
        checked += 3
    nested = sympy.Pow(3, sympy.Pow(2, 5, evaluate=False), evaluate=False)  # 3^(2^5)
    assert digits_bound(nested) >= _digits(3**32)
    assert checked > 1000


@pytest.mark.parametrize("expr", [
    sympy.factorial(99999999, evaluate=False),
    sympy.Pow(9, sympy.Pow(9, 9, evaluate=False), evaluate=False),
    sympy.Pow(10, 10**10, evaluate=False),
    sympy.gamma(sympy.Pow(10, 9, evaluate=False), evaluate=False),
    sympy.Pow(sympy.Symbol("x"), 10**10, evaluate=False),
    sympy.Tuple(1, 2, sympy.Pow(2, 10**6, evaluate=False)),
])
def test_runaway_numbers_are_too_large(expr):
    assert too_large(expr)


def test_answers_as_golds_are_written_are_not_too_large():
    from math_verify import parse

    for text in ["2^{2023}", "2023!", "\\binom{100}{50}", "\\frac{5\\sqrt{3}}{3}", "(-\\infty, -2) \\cup (3, \\infty)",
                 "\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}", "3.14 \\times 10^{8}", "x^2+2x+1", "e^{2}", "0.5"]:
        forms = [f for f in parse(f"${text}$") if not isinstance(f, str)]
        assert forms and not any(too_large(f) for f in forms), text
    assert digits_bound(sympy.Pow(2, 2023, evaluate=False)) < DIGITS_LIMIT


def test_a_tree_35000_deep_is_walked_without_recursion():
    x = sympy.Symbol("x")
    total, tower = x, x
    for _ in range(35000):
        total = sympy.Add(total, 1, evaluate=False)  # x + 1 + 1 + ...: one symbol's digit, the ones add none
        tower = sympy.Pow(x, tower, evaluate=False)  # x^x^x...: a symbol's digit per level
    assert digits_bound(total) == 1.0
    assert digits_bound(tower) == 35001.0 and too_large(tower)


def _recording(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_lenient_grader_never_compares_a_runaway_number(monkeypatch):
    import math_verify.grader

    compared = _recording(monkeypatch, math_verify.grader, "sympy_expr_eq")
    for completion in ["\\boxed{99999999!}", "\\boxed{10^{10^{10}}}", "\\boxed{\\Gamma(10^{9})}"]:
        assert math_reward(completion, "1") == 0.0
    assert compared == []
    assert math_reward("\\boxed{2/4}", "\\frac{1}{2}") == 1.0 and compared  # an ordinary answer is compared
    assert math_reward("\\boxed{10^{10^{10}}}", "10^{10^{10}}") == 1.0  # equal as written: the text forms compare


def test_lenient_grader_reads_a_long_boxed_answer_as_text(monkeypatch):
    import math_verify

    parsed = _recording(monkeypatch, math_verify, "parse")
    tuple_35k = "(" + "1," * 35000 + "1)"
    assert math_reward(f"\\boxed{{{tuple_35k}}}", "1") == 0.0
    assert all(len(args[0]) < 10 for args in parsed)  # the gold alone was parsed
    long_gold = "+".join(f"x_{{{i}}}" for i in range(120))  # 700 characters, the answer as long
    assert math_reward(f"\\boxed{{{long_gold}}}", long_gold) == 1.0
    assert lenient.LONG_ANSWER < len(long_gold) < 2 * len(long_gold)


def test_reference_grader_never_simplifies_a_runaway_number(monkeypatch):
    simplified = _recording(monkeypatch, sympy, "simplify")
    for completion in ["\\boxed{99999999!}", "\\boxed{9**9**9}", "\\boxed{(10**5)!}"]:
        assert reference_math_reward(completion, "\\frac{1}{2}") == 0.0
    assert simplified == []
    assert sympy_equal("1/2", "2/4") and simplified  # an ordinary answer is simplified
    assert sympy_equal("120", "5!") and reference_math_reward("\\boxed{5!+1/2}", "\\frac{241}{2}") == 1.0


def test_with_the_bound_off_the_reference_would_compute(monkeypatch):
    """The test above can fail: without the magnitude check the same answer reaches sympy."""
    monkeypatch.setattr(math_reference, "too_large", lambda expr: False)
    assert magnitude.too_large(sympy.factorial(99999999, evaluate=False))
    simplified = _recording(monkeypatch, sympy, "simplify")
    assert reference_math_reward("\\boxed{(2**3)!}", "\\frac{1}{2}") == 0.0
    assert simplified


def test_an_undefined_function_is_read():
    """f(x) is a sympy Function whose class has no module (OlympiadBench's golds hold such answers)."""
    f = sympy.Function("f")
    assert digits_bound(sympy.Eq(f(sympy.Symbol("x")), sympy.Symbol("x") ** 2)) == 2.0
    assert math_reward("\\boxed{f(x)=x^2}", "f(x)=x^{2}") == 1.0
