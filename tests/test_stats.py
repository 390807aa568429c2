"""emapg.stats against values computed by hand or from tables: the t-test (Student's quantiles), the
exact sign-flip permutation test (enumerated here independently), Holm's step-down correction and the
exact McNemar test."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from emapg.stats import T975, holm, interval95, mcnemar_p, sign_flip_p, t_pvalue, t_sf


@pytest.mark.parametrize("df", sorted(T975))
def test_t_tail_matches_the_quantile_table(df):
    assert 2 * t_sf(T975[df], df) == pytest.approx(0.05, abs=2e-4)  # the table's 3 decimals
    assert t_sf(0.0, df) == pytest.approx(0.5) and t_sf(-1.0, df) == pytest.approx(1 - t_sf(1.0, df))


def test_t_pvalue_of_a_sample_and_its_interval_agree():
    d = [0.02, 0.05, -0.01, 0.04, 0.03]
    lo, hi = interval95(d)
    m, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(5)
    assert t_pvalue(d, "greater") == pytest.approx(t_sf(m / se, 4))
    assert t_pvalue(d, "two-sided") == pytest.approx(2 * t_sf(m / se, 4))
    # the interval excludes 0 exactly when the two-sided p is below 0.05
    assert (lo > 0) == (t_pvalue(d, "two-sided") < 0.05)
    shifted = [x - lo for x in d]  # moved so that the interval's lower end is 0: p = 0.025 one-sided
    assert t_pvalue(shifted, "greater") == pytest.approx(0.025, abs=2e-4)
    assert t_pvalue([0.1, 0.1, 0.1], "greater") == 0.0 and t_pvalue([0.1, 0.1, 0.1], "less") == 1.0


def test_sign_flip_p_is_the_share_of_sign_assignments_at_least_as_extreme():
    d = [0.3, -0.1, 0.2, 0.05, 0.1]
    sums = [sum(s * x for s, x in zip(signs, d, strict=True)) for signs in itertools.product((1, -1), repeat=5)]
    obs = sum(d)
    assert sign_flip_p(d, "greater") == sum(s >= obs - 1e-12 for s in sums) / 32
    assert sign_flip_p(d, "less") == sum(s <= obs + 1e-12 for s in sums) / 32
    assert sign_flip_p(d, "two-sided") == sum(abs(s) >= abs(obs) - 1e-12 for s in sums) / 32
    assert sign_flip_p([1, 2, 3, 4, 5]) == 1 / 32 and sign_flip_p([0.1] * 8) == 1 / 256  # the smallest there is
    assert sign_flip_p([1, -1]) == 3 / 4  # ties with the observed sum count


def test_holm_multiplies_the_ith_smallest_by_m_minus_i_and_keeps_the_order():
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert holm({"a": 0.2, "b": 0.9}) == pytest.approx({"a": 0.4, "b": 0.9})
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}  # at most 1


def test_mcnemar_counts_the_discordant_problems():
    a = [1, 1, 1, 1, 1, 1, 0, 0, 1, 0]
    b = [0, 0, 0, 0, 0, 1, 0, 0, 1, 1]
    only_a, only_b, p = mcnemar_p(a, b)
    assert (only_a, only_b) == (5, 1)
    assert p == pytest.approx(2 * (1 + 6) / 64)  # binomial(6, 1/2): P(X <= 1), both tails
    assert mcnemar_p([1, 0], [1, 0]) == (0, 0, 1.0)
    with pytest.raises(ValueError, match="the problems must be the same"):
        mcnemar_p([1], [1, 0])
