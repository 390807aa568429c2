"""The tests a comparison over seeds reports, as pure functions of its numbers.

Seeds are the units: a configuration's runs and another's with the same seed share their prompts and
sampling seeds, so each claim is about the mean of seed-by-seed differences. Beside the 95% t-interval
(:func:`interval95`) come a t-test's p-value (:func:`t_pvalue`), the exact sign-flip permutation test
(:func:`sign_flip_p`, nonparametric: it assumes only that a difference's sign is as likely either way
when there is no effect), Holm's step-down correction over a family of claims (:func:`holm`), and, per
seed, the exact McNemar test on two models' outcomes on the same held-out problems (:func:`mcnemar_p`).
"""

from __future__ import annotations

import itertools
import math
import statistics

# Two-sided 95% quantiles of Student's t by degrees of freedom (the nearest lower one is used).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def interval95(values: list[float]) -> tuple[float, float]:
    """The 95% t-interval of the mean of ``values`` (seed-by-seed differences)."""
    n = len(values)
    m = statistics.fmean(values)
    if n < 2:
        return m, m
    t = T975[max(d for d in T975 if d <= n - 1)]
    half = t * statistics.stdev(values) / math.sqrt(n)
    return m - half, m + half


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300

    def nonzero(v: float) -> float:
        return v if abs(v) > tiny else tiny

    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 / nonzero(1.0 - qab * x / qap)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        even = m * (b - m) * x / ((qam + m2) * (a + m2))
        d, c = 1.0 / nonzero(1.0 + even * d), nonzero(1.0 + even / c)
        h *= d * c
        odd = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d, c = 1.0 / nonzero(1.0 + odd * d), nonzero(1.0 + odd / c)
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function, for 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_pvalue(diffs: list[float], alternative: str = "greater") -> float:
    """The one-sample t-test's p-value for a mean of ``diffs`` above 0 (``greater``), below it
    (``less``) or either (``two-sided``). A constant sample gives 0 or 1 (the sign decides)."""
    n = len(diffs)
    if n < 2:
        return 1.0
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    if sd == 0.0:
        t = math.inf if m > 0 else -math.inf if m < 0 else 0.0
    else:
        t = m / (sd / math.sqrt(n))
    if alternative == "greater":
        return t_sf(t, n - 1) if math.isfinite(t) else float(t < 0)
    if alternative == "less":
        return t_sf(-t, n - 1) if math.isfinite(t) else float(t > 0)
    return min(1.0, 2.0 * t_sf(abs(t), n - 1)) if math.isfinite(t) else float(t == 0)


def sign_flip_p(diffs: list[float], alternative: str = "greater") -> float:
    """The exact sign-flip permutation test of a mean of paired differences: the share of the 2^n sign
    assignments whose mean is at least as extreme as the observed one (``greater``: as large; ``less``:
    as small; ``two-sided``: as large in absolute value). With n seeds the smallest one-sided p is
    2^-n (1/32 at 5 seeds, 1/256 at 8)."""
    n = len(diffs)
    if n == 0:
        return 1.0
    if n > 20:
        raise ValueError(f"sign_flip_p enumerates 2^n assignments; n = {n} is too many")
    obs = sum(diffs)
    eps = 1e-12 * max(1.0, sum(abs(d) for d in diffs))  # ties up to rounding count as extreme
    hits = 0
    for signs in itertools.product((1.0, -1.0), repeat=n):
        s = sum(sg * d for sg, d in zip(signs, diffs, strict=True))
        if alternative == "greater":
            hits += s >= obs - eps
        elif alternative == "less":
            hits += s <= obs + eps
        else:
            hits += abs(s) >= abs(obs) - eps
    return hits / 2**n


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values over one family: the i-th smallest (of m) times m - i + 1,
    made monotone, at most 1. A claim holds at level alpha, with the family's error rate at most alpha,
    when its adjusted p is below alpha."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, out, running = len(order), {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[name]))
        out[name] = running
    return out


def mcnemar_p(a: list[int], b: list[int]) -> tuple[int, int, float]:
    """The exact McNemar test of two models' 0/1 outcomes on the same problems: (problems only ``a``
    solved, problems only ``b`` solved, two-sided p), the p from the binomial(n_discordant, 1/2)."""
    if len(a) != len(b):
        raise ValueError(f"mcnemar_p: {len(a)} and {len(b)} outcomes; the problems must be the same")
    only_a = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    only_b = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 0, 0, 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return only_a, only_b, min(1.0, 2.0 * tail)
