"""The study's verdicts: the interval against scipy's paired t-test, the decision rules at their edges."""

from __future__ import annotations

import math

import pytest
import scipy.stats as scipy_stats

from mptrain.verdicts import (
    FAILS,
    HOLDS,
    OPEN,
    decide,
    holm,
    judge,
    p_values,
    paired_ci,
    seeds_if_equal,
    seeds_to_decide,
)


def test_paired_ci_matches_scipys_paired_t_test() -> None:
    a = [97.5, 98.1, 96.9, 97.8, 98.3]
    b = [97.9, 97.6, 97.5, 98.4, 98.0]
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean, low, high = paired_ci(diffs)
    ref = scipy_stats.ttest_rel(a, b).confidence_interval(0.95)
    assert mean == pytest.approx(sum(diffs) / 5)
    assert (low, high) == pytest.approx((ref.low, ref.high), rel=1e-9)


def test_one_seed_has_no_interval_and_decides_nothing() -> None:
    _, low, high = paired_ci([0.1])
    assert math.isnan(low) and math.isnan(high)
    assert judge("c", "equivalent", [0.1], 0.5, "pts", []).verdict == OPEN


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [
        (-0.4, 0.4, HOLDS),
        (-0.5, 0.5, HOLDS),
        (-0.6, 0.1, OPEN),
        (0.2, 0.9, OPEN),
        (0.6, 1.0, FAILS),
        (-2.0, -0.51, FAILS),
    ],
)
def test_equivalence_needs_the_whole_interval_inside_the_margin(low: float, high: float, verdict: str) -> None:
    assert decide("equivalent", low, high, 0.5) == verdict


@pytest.mark.parametrize(
    ("low", "high", "sign", "verdict"),
    [
        (-3.0, -0.6, -1, HOLDS),  # accuracy: lower is worse, the whole interval below -margin
        (-3.0, -0.4, -1, OPEN),
        (-0.4, 1.0, -1, FAILS),  # the loss is smaller than the margin everywhere in the interval
        (1.2, 4.0, +1, HOLDS),  # perplexity: higher is worse
        (-1.0, 0.9, +1, FAILS),
        (0.5, 1.5, +1, OPEN),
    ],
)
def test_worse_follows_the_metrics_direction(low: float, high: float, sign: int, verdict: str) -> None:
    assert decide("worse", low, high, 1.0 if sign > 0 else 0.5, worse_sign=sign) == verdict


def test_seeds_to_decide_is_where_the_interval_clears_the_margin() -> None:
    diffs = [0.3, -0.2, 0.5, -0.4, 0.1]  # mean 0.06, sd about 0.37: inconclusive at 5 seeds
    assert judge("c", "equivalent", diffs, 0.5, "pts", []).verdict == OPEN
    n = seeds_to_decide("equivalent", diffs, 0.5)
    assert n is not None and n > 5
    # as many seeds, with the same mean and spread, do decide it; one fewer does not
    sd = scipy_stats.tstd(diffs)
    half = lambda k: scipy_stats.t.ppf(0.975, k - 1) * sd / math.sqrt(k)  # noqa: E731
    assert half(n) < 0.5 - abs(sum(diffs) / 5) <= half(n - 1)


def test_a_clear_loss_is_decided() -> None:
    v = judge("unscaled", "worse", [-4.1, -3.6, -5.0, -4.4, -3.9], 0.5, "pts", ["r"])
    assert v.verdict == HOLDS and v.ci95[1] < -0.5 and v.n_seeds == 5


def test_seeds_if_equal_is_the_tost_sample_size_at_the_observed_spread() -> None:
    diffs = [0.3, -0.2, 0.5, -0.4, 0.1]
    n = seeds_if_equal(diffs, 0.5)
    sd = scipy_stats.tstd(diffs)
    need = lambda k: (scipy_stats.t.ppf(0.975, k - 1) + scipy_stats.t.ppf(0.9, k - 1)) * sd / math.sqrt(k)  # noqa: E731
    assert n is not None and need(n) <= 0.5 < need(n - 1)
    # it ignores the observed mean: shifting every diff leaves it unchanged, unlike seeds_to_decide
    assert seeds_if_equal([d + 0.3 for d in diffs], 0.5) == n
    # by hand, sd = margin: n = 13, where (t(.975, 12) + t(.9, 12)) / sqrt(13) = (2.179 + 1.356) / 3.606
    # = 0.980 <= 1; at 12, (2.201 + 1.363) / 3.464 = 1.029 > 1
    assert seeds_if_equal([-1.0, 1.0], 1.0 * math.sqrt(2)) == 13


@pytest.mark.parametrize("shift", [0.0, 0.45, 0.7, -0.9])
def test_equivalence_p_value_is_scipys_two_one_sided_tests(shift: float) -> None:
    diffs = [shift + d for d in (0.1, -0.15, 0.05, 0.2, -0.05)]
    p_hold, p_fail = p_values("equivalent", diffs, 0.5)
    lower = scipy_stats.ttest_1samp(diffs, -0.5, alternative="greater").pvalue
    upper = scipy_stats.ttest_1samp(diffs, 0.5, alternative="less").pvalue
    assert p_hold == pytest.approx(max(lower, upper), rel=1e-9)
    assert p_fail == pytest.approx(min(1 - lower, 1 - upper), rel=1e-9)
    # the interval and the p-value say the same thing
    v = judge("c", "equivalent", diffs, 0.5, "pts", [])
    assert (v.verdict == HOLDS) == (p_hold < 0.025) and (v.verdict == FAILS) == (p_fail < 0.025)


@pytest.mark.parametrize(("diffs", "sign"), [([-4.1, -3.6, -5.0, -4.4, -3.9], -1), ([1.2, 1.5, 1.7, 1.3, 1.8], +1),
                                               ([0.2, -0.3, 0.1, 0.4, 0.0], -1)])
def test_worse_p_value_is_scipys_one_sided_test(diffs: list[float], sign: int) -> None:
    margin = 0.5 if sign < 0 else 1.0
    p_hold, p_fail = p_values("worse", diffs, margin, sign)
    worse_than = [-d for d in diffs] if sign > 0 else diffs  # worse is negative
    ref = scipy_stats.ttest_1samp(worse_than, -margin, alternative="less").pvalue
    assert p_hold == pytest.approx(ref, rel=1e-9) and p_fail == pytest.approx(1 - ref, rel=1e-9)
    v = judge("c", "worse", diffs, margin, "u", [], sign)
    assert (v.verdict == HOLDS) == (p_hold < 0.025) and (v.verdict == FAILS) == (p_fail < 0.025)
    assert v.p_value == pytest.approx(min(p_hold, p_fail))


def test_holm_by_hand() -> None:
    # alpha 0.025 over 4 tests: thresholds 0.00625, 0.00833, 0.0125, 0.025 for the sorted p-values
    assert holm([0.001, 0.02, 0.008, math.nan, 0.011]) == [True, True, True, False, True]
    assert holm([0.001, 0.02, 0.009, 0.011]) == [True, False, False, False]  # 0.009 > 0.025/3 stops it
    assert holm([0.03]) == [False] and holm([]) == []
