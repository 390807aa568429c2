"""How large the exact numbers in a sympy expression can get: a bound read off the unevaluated tree, so that a
grader refuses ``99999999!``, ``9**9**9`` or ``10^{10^{10}}`` before sympy tries to compute them (each would
take minutes to hours, or all the memory there is) instead of waiting for a time bound.

The bound is an upper bound on the decimal digits of every exact number that evaluating the expression could
produce, counted over the tree bottom up (a symbol counts as one digit, so that ``x^{10^{10}}`` is refused too):

- an integer ``p``: ``log10|p|``; a rational: its numerator's and denominator's digits together; a float: the
  digits of its exponent's scale (sympy may turn a float into an exact rational);
- a sum or a product: the digits of its terms added (a sum of fractions has their denominators' product below);
- a power ``b^e``: ``b``'s digits times ``|e|`` (for an exponent not yet a number, ``10`` to its digits); an
  exponent with a symbol in it is not computed, so its digits are only added;
- a factorial, binomial, gamma or other combinatorial or number-theoretic function of ``n``: ``n log10(n+1) + 1``,
  the digits of ``n^n``, above ``n!``, a binomial, a subfactorial, a Bell, Catalan or Fibonacci number of ``n``
  (and the n-th prime's work is refused with it);
- a tuple, set, interval, matrix or relation: its largest element (elements are compared one by one);
- any other function: its arguments' digits added.

No answer to a competition problem comes near :data:`DIGITS_LIMIT` (``2^{2023}`` has 610 digits, ``2023!`` 5,800,
bounded at 6,700; no gold of five published sets is bounded above 304: ``bench/grader_bounds.py``). The bound is
on each number an expression holds, not on its value: an answer whose parts are too large is not equal even where
their quotient is small, e.g. ``2^{100000}/2^{100001}`` against ``1/2``, which the reference grades equal in
milliseconds and emapg grades not equal. That is the price of never computing a runaway answer; no published
gold has such parts.
"""

from __future__ import annotations

import math

DIGITS_LIMIT = 10_000
_LOG10_2 = math.log10(2)


def _int_digits(p: int) -> float:
    """``log10|p|`` (0 for 0 and 1), from the bit length for an integer too long for a float."""
    p = abs(p)
    return math.log10(p) if 1 < p < 2**1000 else 0.0 if p <= 1 else p.bit_length() * _LOG10_2


def _value_bound(node, digits: float) -> float:
    """An upper bound on ``|node|`` given its digits (its exact value when it is an integer or a rational)."""
    import sympy  # (heavy, ~0.5 s: only when an answer needs it)

    if isinstance(node, sympy.Rational):
        return abs(float(node)) if _int_digits(node.p) < 300 else math.inf
    return 10.0 ** digits if digits < 300 else math.inf


def _leaf_digits(node) -> float | None:
    """The digits of a number or a symbol, or None for a node with arguments."""
    import sympy  # (heavy, ~0.5 s: only when an answer needs it)

    if isinstance(node, sympy.Integer):
        return _int_digits(node.p)
    if isinstance(node, sympy.Rational):
        return _int_digits(node.p) + _int_digits(node.q)
    if isinstance(node, sympy.Float):
        _sign, _mantissa, exponent, bits = node._mpf_
        return abs(exponent + bits) * _LOG10_2 + 1
    if isinstance(node, sympy.Basic) and not node.args:
        return 1.0  # a symbol, pi, E, I, oo, an empty set
    return None


def _counting(node) -> bool:
    """Whether sympy computes the function's value as an exact integer or rational of its argument's size."""
    import sympy  # (heavy, ~0.5 s: only when an answer needs it)

    module = type(node).__module__ or ""  # an undefined function, f(x), has none
    return isinstance(node, sympy.Function) and (
        module.startswith(("sympy.functions.combinatorial", "sympy.ntheory")) or module.endswith("gamma_functions"))


def _node_digits(node, children: list[float], args: tuple, symbolic: list[bool]) -> float:
    """A node's digits from its arguments' (``symbolic``: whether each argument holds a symbol)."""
    import sympy  # (heavy, ~0.5 s: only when an answer needs it)

    if isinstance(node, sympy.Pow):
        (base, base_digits), (exponent, exp_digits) = zip(args, children, strict=True)
        if symbolic[1]:
            return base_digits + exp_digits
        if isinstance(base, sympy.Integer) and abs(base.p) <= 1:
            return exp_digits  # 1^n, 0^n, (-1)^n
        return base_digits * max(_value_bound(exponent, exp_digits), 1.0)
    if _counting(node):
        n = max((_value_bound(a, d) for a, d in zip(args, children, strict=True)), default=0.0)
        return n * math.log10(n + 1) + 1 if n != math.inf else math.inf
    if isinstance(node, sympy.Tuple | sympy.Set | sympy.Interval | sympy.core.relational.Relational):
        return max(children, default=0.0)
    return sum(children)


def digits_bound(expr) -> float:
    """An upper bound on the decimal digits of the exact numbers evaluating ``expr`` produces (see the module);
    ``math.inf`` when it has no finite bound. Walks the tree without recursion (a model can nest 35,000 deep)."""
    import sympy  # (heavy, ~0.5 s: only when an answer needs it)
    from sympy.matrices import MatrixBase  # (heavy: as sympy)

    stack: list[tuple[object, bool]] = [(expr, False)]
    done: list[tuple[float, bool]] = []  # each finished node's digits and whether it holds a symbol
    while stack:
        node, expanded = stack.pop()
        args = tuple(node) if isinstance(node, MatrixBase) else getattr(node, "args", ())
        if not isinstance(node, sympy.Basic | MatrixBase):
            done.append((0.0, False))  # a string form beside the parsed one, or a Python value
        elif not expanded and (leaf := _leaf_digits(node)) is not None and not isinstance(node, MatrixBase):
            done.append((leaf, isinstance(node, sympy.Symbol)))
        elif not expanded:
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(args))
        else:
            finished = [done.pop() for _ in args][::-1]
            children, symbolic = [d for d, _ in finished], [s for _, s in finished]
            digits = (max(children, default=0.0) if isinstance(node, MatrixBase)
                      else _node_digits(node, children, args, symbolic))
            done.append((digits, any(symbolic)))
    return done[-1][0]


def too_large(expr, limit: float = DIGITS_LIMIT) -> bool:
    """Whether evaluating ``expr`` exactly could produce a number of more than ``limit`` decimal digits. A tree
    this bound cannot read (a node of a kind sympy adds later) is left to the graders' time bounds: a grade is
    never lost to the bound itself."""
    try:
        return digits_bound(expr) > limit
    except (AttributeError, TypeError, ValueError, OverflowError):
        return False
