"""The study's verdicts: the interval against scipy's paired t-test, the decision rules at their edges."""

from __future__ import annotations

import math

import pytest
import scipy.stats as scipy_stats

from mptrain.verdicts import FAILS, HOLDS, OPEN, decide, judge, paired_ci, seeds_to_decide


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
