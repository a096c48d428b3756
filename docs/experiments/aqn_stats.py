"""Statistics of the AQN experiment (``aqn_seeds.py`` writes the JSON, ``aqn_report.py`` turns it into a page): pure
functions of numbers, no plotting, no files.

Per run (one arm, one seed):
- ``area_under_curve``: the trapezoidal area under the train-reward curve divided by the steps it spans, i.e. the mean
  reward level over training (a faster learner has a larger area at the same final value).
- ``first_reaching``: the first step at which held-out accuracy reaches a fixed level; ``None`` when it never does.
- ``early_mean``: the mean of the first K steps of a curve (early-training entropy).
- ``entropy_rise``: the mean of a curve over an early window minus its mean over the steps before it (the noise-free
  first AQN stage): how much the rollout entropy went up early in the run.

Over seeds (Student t, two-sided):
- ``mean_interval``: mean and confidence interval of one arm's values.
- ``paired_difference``: mean and interval of the per-seed differences of two arms run with the same seeds, and
  its p-value (the paired t-test): the seeds are shared, so the difference removes what the seed does to both.
- ``correlation``: Pearson's r of two per-run values with a Fisher-z interval and the t-test p-value of r = 0;
  ``within_groups`` first takes each group's (arm's) mean out of both, so that r says whether runs that rose more
  than their arm's mean also scored more, not whether the arms differ in both (one degree of freedom per group less).
- ``censored_steps``: steps-to-level with runs that never reach the level counted at the run's length (right
  censored): the mean is then a lower bound, and ``reached`` says how many runs count exactly.

The t distribution is computed here (the regularized incomplete beta function by its continued fraction), so the
statistics need nothing beyond the standard library; the tests check it against closed forms and table values.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from statistics import NormalDist
from typing import NamedTuple


class Interval(NamedTuple):
    """Mean and two-sided confidence interval over ``n`` values (``low``/``high`` nan when n < 2)."""

    mean: float
    low: float
    high: float
    n: int
    sd: float  # sample standard deviation (n - 1 in the denominator)
    p_value: float  # two-sided t-test of "the true mean is 0" (nan when n < 2 or sd = 0 with mean 0)


class Correlation(NamedTuple):
    """Pearson's r over ``n`` pairs with a two-sided confidence interval (nan when it cannot be computed)."""

    r: float
    low: float
    high: float
    n: int
    p_value: float  # two-sided t-test of "the true correlation is 0"


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), as in Numerical Recipes' ``betacf``."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0 and x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast on this side; use the symmetry else
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}.")
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (the inverse of ``t_cdf``), by bisection to float precision."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}.")
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-15 * max(1.0, high):
            break
    return 0.5 * (low + high)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean and Student-t interval over ``values`` (one value per seed; nan: a seed without this value, left out), with
    the t-test p-value of mean 0."""
    xs = [float(v) for v in values if not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, math.nan, math.nan)
    mean = math.fsum(xs) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, 1, math.nan, math.nan)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_ppf(0.5 + confidence / 2.0, n - 1) * se
    if se > 0:
        p_value = 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    else:
        p_value = math.nan if mean == 0 else 0.0
    return Interval(mean, mean - half, mean + half, n, sd, p_value)


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean and interval of ``a[i] - b[i]`` (the same seed ``i`` in both arms), with the paired t-test p-value; a seed
    with nan on either side is left out."""
    if len(a) != len(b):
        raise ValueError(f"paired values need one value per seed in both arms, got {len(a)} and {len(b)}.")
    return mean_interval([x - y for x, y in zip(a, b)], confidence)


def area_under_curve(steps: Sequence[float], values: Sequence[float]) -> float:
    """Trapezoidal area under ``values`` over ``steps``, divided by the span of ``steps`` (the mean level); a single
    point is its own value."""
    if len(steps) != len(values) or not steps:
        raise ValueError(f"a curve needs as many steps as values (>= 1), got {len(steps)} and {len(values)}.")
    if len(steps) == 1:
        return float(values[0])
    area = math.fsum((s1 - s0) * (v0 + v1) / 2.0 for s0, s1, v0, v1 in zip(steps, steps[1:], values, values[1:]))
    return area / (steps[-1] - steps[0])


def first_reaching(steps: Sequence[int], values: Sequence[float], level: float) -> int | None:
    """The first step whose value is >= ``level``; ``None`` when none is."""
    return next((s for s, v in zip(steps, values) if v >= level), None)


def censored_steps(first_steps: Sequence[int | None], censor_at: int, confidence: float = 0.95) -> tuple[Interval, int]:
    """Steps-to-level over seeds with the runs that never reached it counted at ``censor_at`` (the run length): the
    interval of those values, and how many runs reached the level (when fewer than all, the mean is a lower bound)."""
    reached = sum(s is not None for s in first_steps)
    return mean_interval([censor_at if s is None else s for s in first_steps], confidence), reached


def early_mean(values: Sequence[float], k: int) -> float:
    """Mean of the first ``k`` values (all of them when there are fewer)."""
    if k < 1 or not values:
        raise ValueError(f"early_mean needs k >= 1 and at least one value, got k={k} and {len(values)} values.")
    head = [float(v) for v in values[:k]]
    return math.fsum(head) / len(head)


def entropy_rise(values: Sequence[float], baseline: int, window: int) -> float:
    """Mean of ``values[baseline:window]`` (the early window after the baseline steps) minus the mean of
    ``values[:baseline]``."""
    if not 1 <= baseline < window <= len(values):
        raise ValueError(f"entropy_rise needs 1 <= baseline < window <= {len(values)} values, got baseline={baseline} "
                         f"and window={window}.")
    return early_mean(values[baseline:window], window - baseline) - early_mean(values, baseline)


def correlation(x: Sequence[float], y: Sequence[float], controls: int = 0, confidence: float = 0.95) -> Correlation:
    """Pearson's r of ``x`` and ``y`` with the Fisher-z interval ``tanh(atanh(r) +- z / sqrt(n - 3 - controls))`` and
    the p-value of ``t = r sqrt(df / (1 - r^2))``, ``df = n - 2 - controls``; ``controls``: variables already taken
    out of both (see ``within_groups``)."""
    if len(x) != len(y):
        raise ValueError(f"a correlation needs one y per x, got {len(x)} and {len(y)}.")
    n = len(x)
    nan = Correlation(math.nan, math.nan, math.nan, n, math.nan)
    if n - 2 - controls < 1:
        return nan
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = math.fsum((a - mx) ** 2 for a in x), math.fsum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return nan
    r = max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))
    df = n - 2 - controls
    p_value = 0.0 if abs(r) == 1 else 2.0 * (1.0 - t_cdf(abs(r) * math.sqrt(df / (1.0 - r * r)), df))
    if n - 3 - controls < 1 or abs(r) == 1:
        return Correlation(r, math.nan, math.nan, n, p_value)
    half = NormalDist().inv_cdf(0.5 + confidence / 2.0) / math.sqrt(n - 3 - controls)
    z = math.atanh(r)
    return Correlation(r, math.tanh(z - half), math.tanh(z + half), n, p_value)


def within_groups(x: Sequence[float], y: Sequence[float], groups: Sequence[Hashable],
                  confidence: float = 0.95) -> Correlation:
    """The correlation of ``x`` and ``y`` after each group's mean is subtracted from both (the pooled within-group
    correlation): one control per group beyond the first."""
    if not len(x) == len(y) == len(groups):
        raise ValueError(f"within_groups needs one x, y and group per run, got {len(x)}, {len(y)}, {len(groups)}.")
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    dx, dy = list(map(float, x)), list(map(float, y))
    for rows in members.values():
        mx, my = math.fsum(dx[i] for i in rows) / len(rows), math.fsum(dy[i] for i in rows) / len(rows)
        for i in rows:
            dx[i], dy[i] = dx[i] - mx, dy[i] - my
    return correlation(dx, dy, controls=len(members) - 1, confidence=confidence)
