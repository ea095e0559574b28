"""Verdicts on a paper's claim from paired runs: a 95% confidence interval, and what would decide it.

A claim compares a treatment with a reference run on the same seed (same initial weights, same
batch order), so the seed-to-seed spread that both share cancels in the difference. The interval
is Student's t on those paired differences. Two kinds of claim:

- ``equivalent``: the treatment matches the reference within ``margin`` (the papers' parity). It
  holds when the whole interval lies inside ``[-margin, margin]``, and does not hold when the whole
  interval lies outside it.
- ``worse``: the treatment is worse than the reference by more than ``margin`` (FP16 without loss
  scaling "loses accuracy"). It holds when the whole interval lies beyond ``margin`` on the worse
  side, and does not hold when the whole interval lies on the better side of it.

Anything else is ``inconclusive``, and :func:`seeds_to_decide` says how many seeds would decide it
if the mean and the spread stayed as measured. That assumes the observed mean is the true one, so
:func:`seeds_if_equal` also says how many an equivalence verdict needs if the true difference were
0 (issue 18). Each part's interval is a one-sided test at 2.5%; :func:`p_value` gives that test's
p-value and :func:`holm` corrects them over every part of the study at once.

Which runs enter a claim is :func:`pair`'s: one run of the treatment and one of the reference per
seed, with equal pairing digests; a :class:`Margin` turns each pair into the claim's difference
(points, or % of the reference), and :func:`log_error_ratio` into the log of an accuracy's
error-rate ratio. ``mptrain-report --verdicts`` (mptrain/sweep.py) and the study harness
(``scripts/study.py``) both judge through these; no torch needed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from typing import Literal

from mptrain.errors import MptrainError

Kind = Literal["equivalent", "worse"]
HOLDS, FAILS, OPEN = "holds", "does not hold", "inconclusive"


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (scipy, which scikit-learn already brings in for data=digits)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def paired_ci(diffs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)`` of the paired differences; the interval is nan for fewer than 2."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return mean, math.nan, math.nan
    half = t_quantile(0.5 + level / 2, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return mean, mean - half, mean + half


def decide(kind: Kind, low: float, high: float, margin: float, worse_sign: int = -1) -> str:
    """The verdict from an interval. ``worse_sign`` is -1 where lower is worse (accuracy) and +1
    where higher is worse (perplexity)."""
    if math.isnan(low) or math.isnan(high):
        return OPEN
    if kind == "equivalent":
        if -margin <= low and high <= margin:
            return HOLDS
        if high < -margin or low > margin:
            return FAILS
        return OPEN
    # worse: flip so that "worse" is negative, then the claim is "the effect is below -margin"
    lo, hi = (low, high) if worse_sign < 0 else (-high, -low)
    if hi < -margin:
        return HOLDS
    if lo > -margin:
        return FAILS
    return OPEN


def seeds_to_decide(kind: Kind, diffs: list[float], margin: float, worse_sign: int = -1, cap: int = 1000) -> int | None:
    """Seeds at which the interval would clear the margin, if the mean and standard deviation
    stayed as measured; None when no number of seeds would (the mean sits on the margin)."""
    if len(diffs) < 2:
        return None
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    if kind == "worse":
        mean = mean if worse_sign < 0 else -mean
        gap = abs(mean + margin)  # distance from the -margin boundary
    else:
        gap = abs(margin - abs(mean))
    if gap == 0:
        return None
    for n in range(2, cap + 1):
        if t_quantile(0.975, n - 1) * sd / math.sqrt(n) < gap:
            return n
    return None


def seeds_if_equal(diffs: list[float], margin: float, power: float = 0.8, cap: int = 10000) -> int | None:
    """Seeds an equivalence verdict needs if the true difference were 0, at the observed spread.

    The smallest n with (t(0.975, n-1) + t(1 - (1-power)/2, n-1)) * sd / sqrt(n) <= margin: the
    usual two-one-sided-tests sample size at 2.5% per side (our 95% interval), so that the interval
    lands inside the margin with probability ``power``. None for fewer than 2 diffs or past cap.
    """
    if len(diffs) < 2:
        return None
    sd = statistics.stdev(diffs)
    if sd == 0:
        return 2
    beta = 1 - (1 - power) / 2
    for n in range(2, cap + 1):
        if (t_quantile(0.975, n - 1) + t_quantile(beta, n - 1)) * sd / math.sqrt(n) <= margin:
            return n
    return None


def _t_sf(x: float, df: int) -> float:
    from scipy.stats import t

    return float(t.sf(x, df))


def p_values(kind: Kind, diffs: list[float], margin: float, worse_sign: int = -1) -> tuple[float, float]:
    """``(p_holds, p_fails)``: the one-sided t-test p-values behind the two verdicts. The 95%
    interval decides a part exactly when the matching p-value is below 0.025."""
    n = len(diffs)
    if n < 2:
        return math.nan, math.nan
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    if se == 0:
        se = 1e-300  # a constant difference: the tests are as sharp as they get
    df = n - 1
    if kind == "equivalent":
        # holds: both H0 "mean <= -margin" and H0 "mean >= margin" rejected (TOST)
        p_hold = max(_t_sf((mean + margin) / se, df), _t_sf((margin - mean) / se, df))
        # fails: the mean lies beyond one side of the margin
        p_fail = min(_t_sf((mean - margin) / se, df), _t_sf((-margin - mean) / se, df))
        return p_hold, p_fail
    x = mean if worse_sign < 0 else -mean  # worse is negative
    # holds: H0 "x >= -margin" rejected (the whole interval below -margin); fails: H0 "x <= -margin"
    p_hold = 1 - _t_sf((x + margin) / se, df)
    return p_hold, _t_sf((x + margin) / se, df)


def p_value(kind: Kind, diffs: list[float], margin: float, worse_sign: int = -1) -> float:
    """The p-value of the verdict the interval reached; for an inconclusive part, the smaller of
    the two (both are then at least 0.025)."""
    p_hold, p_fail = p_values(kind, diffs, margin, worse_sign)
    if math.isnan(p_hold):
        return math.nan
    return min(p_hold, p_fail)


def holm(pvals: list[float], alpha: float = 0.025) -> list[bool]:
    """Holm's step-down over a family: which p-values stay significant at family-wise ``alpha``.

    nan (nothing measured) never survives and does not count in the family."""
    order = sorted((p, i) for i, p in enumerate(pvals) if not math.isnan(p))
    m = len(order)
    keep = [False] * len(pvals)
    for j, (p, i) in enumerate(order):
        if p > alpha / (m - j):
            break
        keep[i] = True
    return keep


@dataclass
class Verdict:
    claim: str
    verdict: str
    effect: float  # mean paired difference, in the claim's unit
    ci95: tuple[float, float]
    n_seeds: int
    margin: float
    unit: str
    kind: str
    seeds_to_decide: int | None
    runs: list[str]
    seeds_if_equal: int | None = None  # seeds equivalence needs if the true difference were 0
    p_value: float = math.nan  # one-sided test of the verdict reached (see p_value)
    holm: bool | None = None  # survives Holm over the whole study (set by the report)

    def as_dict(self) -> dict:
        return asdict(self)


def judge(
    claim: str,
    kind: Kind,
    diffs: list[float],
    margin: float,
    unit: str,
    runs: list[str],
    worse_sign: int = -1,
) -> Verdict:
    """One claim's verdict from its paired differences (treatment - reference, per seed)."""
    if not diffs:
        return Verdict(claim, OPEN, math.nan, (math.nan, math.nan), 0, margin, unit, kind, None, runs)
    mean, low, high = paired_ci(diffs)
    verdict = decide(kind, low, high, margin, worse_sign)
    need = None if verdict != OPEN else seeds_to_decide(kind, diffs, margin, worse_sign)
    if_equal = seeds_if_equal(diffs, margin) if kind == "equivalent" else None
    p = p_value(kind, diffs, margin, worse_sign)
    return Verdict(claim, verdict, mean, (low, high), len(diffs), margin, unit, kind, need, runs, if_equal, p)


def combine(verdicts: list[str]) -> str:
    """A claim made of parts holds when every part holds, fails when any part fails."""
    if any(v == FAILS for v in verdicts):
        return FAILS
    if verdicts and all(v == HOLDS for v in verdicts):
        return HOLDS
    return OPEN


# ------------------------------------------------------------------------------------ margins and pairs


@dataclass(frozen=True)
class Margin:
    """A claim's margin: ``relative`` in % of the reference's value (``1%``), else absolute in the
    metric's own unit (``0.5``: points of top-1)."""

    value: float
    relative: bool = False

    @classmethod
    def parse(cls, text: str | float) -> Margin:
        s = str(text).strip()
        rel = s.endswith("%")
        try:
            v = float(s[:-1] if rel else s)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v > 0):
            raise MptrainError(f"--margin {text}: must be a positive number, relative with % (1%) or absolute (0.5)")
        return cls(v, rel)

    def diff(self, x: float, ref: float) -> float:
        """The paired difference in the margin's unit: 100 (x / ref - 1), or x - ref."""
        return 100 * (x / ref - 1) if self.relative else x - ref

    def unit(self, metric: str) -> str:
        if self.relative:
            return f"% {metric}"
        return "points top-1" if metric == "top1" else metric

    def __str__(self) -> str:
        return f"{self.value:g}%" if self.relative else f"{self.value:g}"


def log_error_ratio(acc: float, ref_acc: float, full: float = 100.0) -> float | None:
    """ln(error / reference error) for accuracies in % (error = full - accuracy): near 100% an
    absolute margin says little, a ratio of errors does. None when either error is 0."""
    err, ref = full - acc, full - ref_acc
    return math.log(err / ref) if err > 0 and ref > 0 else None


@dataclass
class Obs:
    """One run's observation, as a paired comparison needs it."""

    name: str
    seed: int
    value: float | None  # the metric; None when the run has no finite one (it diverged)
    digest: Hashable | None  # its pairing digests; None: it cannot be paired
    left_out: str | None = None  # why it may not enter any claim (stale, another commit, failed)


@dataclass
class Pairs:
    """The seeds where the treatment and the reference are paired, and what was left out."""

    seeds: list[int] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)  # +inf where the treatment diverged
    names: list[str] = field(default_factory=list)  # [treatment, reference] per seed
    diverged: list[int] = field(default_factory=list)  # seeds where the treatment has no finite value
    unpaired: list[str] = field(default_factory=list)  # "name (why)" of every run left out

    @property
    def finite(self) -> list[float]:
        return [] if self.diverged else self.diffs


def pair(cell: list[Obs], ref: list[Obs], diff: Callable[[float, float], float | None]) -> Pairs:
    """Per seed with one run of each: both may enter, their digests are equal, and the reference has
    a value. ``diff(x, ref)`` is the claim's difference (None: not defined for this pair, e.g. an
    error ratio with a zero error: left out and named). A treatment without a finite value counts as
    +inf (it diverged where the reference did not): its claim gets no interval."""
    out = Pairs()
    by_ref = {o.seed: o for o in ref}
    for o in sorted(cell, key=lambda o: o.seed):
        r = by_ref.get(o.seed)
        why = (o.left_out or (f"its reference {r.name} is left out: {r.left_out}" if r and r.left_out else None)
               or ("no reference run of its seed" if r is None else None)
               or ("no pairing digests" if o.digest is None or r.digest is None else None)  # type: ignore[union-attr]
               or (f"pairing digests differ from {r.name}'s" if o.digest != r.digest else None)  # type: ignore[union-attr]
               or (f"{r.name} has no finite value" if r.value is None else None))  # type: ignore[union-attr]
        if why:
            out.unpaired.append(f"{o.name} ({why})")
            continue
        assert r is not None and r.value is not None
        d = math.inf if o.value is None else diff(o.value, r.value)
        if d is None:
            out.unpaired.append(f"{o.name} (the difference is undefined for this pair)")
            continue
        if o.value is None:
            out.diverged.append(o.seed)
        out.seeds.append(o.seed)
        out.diffs.append(d)
        out.names += [o.name, r.name]
    return out


def holm_parts(parts: list[dict]) -> None:
    """Set each part's ``holm``: Holm over every distinct hypothesis (a part that two claims share
    counts once: same kind, margin and runs), at 2.5% family-wise, the one-sided level each 95%
    interval uses; a decided part survives when its p-value passes."""
    keys: dict[tuple, float] = {}
    for p in parts:
        keys.setdefault((p["kind"], p["margin"], tuple(p["runs"])), p["p_value"])
    order = list(keys)
    keep = dict(zip(order, holm([keys[k] for k in order]), strict=True))
    for p in parts:
        decided = p["verdict"] not in (OPEN, "not measured")
        p["holm"] = bool(decided and keep[(p["kind"], p["margin"], tuple(p["runs"]))])
