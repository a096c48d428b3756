"""The statistics of the AQN experiment against closed forms of the t distribution, published t-table values and
hand-computed float64 values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from .conftest import load_script

stats = load_script("aqn_stats")


@pytest.mark.parametrize("t", [-30.0, -4.0, -1.3, -0.2, 0.0, 0.5, 1.0, 2.7, 12.0, 500.0])
def test_t_cdf_matches_the_closed_forms_for_one_two_and_three_degrees_of_freedom(t):
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)  # Cauchy
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(t * t + 2)), abs=1e-13)
    u = t / math.sqrt(3)
    assert stats.t_cdf(t, 3) == pytest.approx(0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi, abs=1e-13)


def test_t_cdf_tends_to_the_normal_for_many_degrees_of_freedom():
    for t in (-2.5, -1.0, 0.3, 1.96):
        assert stats.t_cdf(t, 1e7) == pytest.approx(0.5 * (1 + math.erf(t / math.sqrt(2))), abs=1e-7)


@pytest.mark.parametrize("df, quantile", [
    (1, 12.706204736174707),  # tan(0.475 pi)
    (2, 4.302652729749464),   # 0.95 * sqrt(2 / (1 - 0.95^2)), the df = 2 closed form
    (3, 3.182446305284263),   # from here on: the two-sided 95% column of published t tables (to 15 digits)
    (4, 2.776445105197793),
    (5, 2.570581835636314),
    (9, 2.262157162798205),
    (10, 2.228138851986274),
    (29, 2.045229642132703),
])
def test_t_ppf_gives_the_975_quantile_of_t_tables(df, quantile):
    assert stats.t_ppf(0.975, df) == pytest.approx(quantile, rel=1e-9)
    assert stats.t_ppf(0.025, df) == pytest.approx(-quantile, rel=1e-9)
    assert stats.t_cdf(stats.t_ppf(0.9, df), df) == pytest.approx(0.9, abs=1e-12)


def test_mean_interval_of_three_seeds_by_hand():
    # values 0.1 0.2 0.1: mean 0.13333, sd = sqrt(((1/30)^2 * 2 + (2/30)^2) / 2) = 0.057735, se = 1/30,
    # half width = t(0.975, 2) * se = 4.3026527 / 30 = 0.1434218; t = 4, p = 1 - 4 / sqrt(18) = 0.0571910
    interval = stats.mean_interval([0.1, 0.2, 0.1])
    assert interval.mean == pytest.approx(0.4 / 3, abs=1e-15)
    assert interval.sd == pytest.approx(math.sqrt(1 / 300), rel=1e-12)
    assert interval.low == pytest.approx(0.4 / 3 - 4.302652729749464 / 30, rel=1e-9)
    assert interval.high == pytest.approx(0.4 / 3 + 4.302652729749464 / 30, rel=1e-9)
    assert interval.p_value == pytest.approx(1 - 4 / math.sqrt(18), rel=1e-9)
    assert interval.n == 3


def test_paired_difference_is_the_interval_of_the_per_seed_differences():
    a, b = [0.5, 0.6, 0.7], [0.4, 0.4, 0.6]  # differences 0.1 0.2 0.1, as above
    paired = stats.paired_difference(a, b)
    assert paired.mean == pytest.approx(0.4 / 3) and paired.p_value == pytest.approx(1 - 4 / math.sqrt(18), rel=1e-9)
    # Unpaired, the same numbers are far less certain: the seed effect common to both arms is not removed.
    assert stats.mean_interval(a).high - stats.mean_interval(a).low > paired.high - paired.low
    with pytest.raises(ValueError, match="one value per seed"):
        stats.paired_difference([1.0], [1.0, 2.0])


def test_degenerate_sample_sizes_and_spreads():
    assert stats.mean_interval([0.3]).mean == 0.3 and math.isnan(stats.mean_interval([0.3]).low)
    assert math.isnan(stats.mean_interval([]).mean)
    constant = stats.mean_interval([0.5, 0.5, 0.5])
    assert (constant.low, constant.high, constant.p_value) == (0.5, 0.5, 0.0)


def test_area_under_curve_is_the_mean_level_of_the_trapezoids():
    assert stats.area_under_curve([1, 2, 3], [0.0, 1.0, 1.0]) == pytest.approx((0.5 + 1.0) / 2)
    assert stats.area_under_curve([0, 10, 30], [0.2, 0.4, 0.4]) == pytest.approx((10 * 0.3 + 20 * 0.4) / 30)
    assert stats.area_under_curve([5], [0.7]) == 0.7
    with pytest.raises(ValueError, match="as many steps as values"):
        stats.area_under_curve([1, 2], [0.5])


def test_first_reaching_and_censoring():
    assert stats.first_reaching([0, 20, 40, 60], [0.1, 0.3, 0.5, 0.45], 0.5) == 40
    assert stats.first_reaching([0, 20], [0.6, 0.7], 0.5) == 0
    assert stats.first_reaching([0, 20], [0.1, 0.2], 0.5) is None
    interval, reached = stats.censored_steps([40, None, 20], censor_at=100)
    assert reached == 2 and interval.mean == pytest.approx(160 / 3)


def test_early_mean():
    assert stats.early_mean([1.0, 2.0, 4.0, 8.0], 3) == pytest.approx(7 / 3)
    assert stats.early_mean([1.0, 2.0], 5) == 1.5
    with pytest.raises(ValueError, match="k >= 1"):
        stats.early_mean([1.0], 0)


def test_entropy_rise_is_the_window_mean_minus_the_baseline_mean():
    assert stats.entropy_rise([2.0, 2.0, 3.0, 5.0, 1.0], baseline=2, window=4) == pytest.approx(4.0 - 2.0)
    assert stats.entropy_rise([1.0, 0.5], baseline=1, window=2) == pytest.approx(-0.5)
    for baseline, window in ((0, 2), (2, 2), (1, 6)):
        with pytest.raises(ValueError, match="baseline < window"):
            stats.entropy_rise([1.0] * 5, baseline, window)


def t3_two_sided_p(t: float) -> float:
    """The df = 3 closed form of the t distribution (as in the test above), two-sided."""
    u = abs(t) / math.sqrt(3)
    return 2 * (0.5 - (u / (1 + u * u) + math.atan(u)) / math.pi)


def test_correlation_by_hand_with_its_fisher_interval_and_p_value():
    # dx = -2 -1 0 1 2, dy = -1 -2 1 0 2: sxy = 8, sxx = syy = 10, r = 0.8; df = 3, t = 0.8 sqrt(3 / 0.36)
    c = stats.correlation([1, 2, 3, 4, 5], [2, 1, 4, 3, 5])
    assert c.r == pytest.approx(0.8, abs=1e-15) and c.n == 5
    assert c.p_value == pytest.approx(t3_two_sided_p(0.8 * math.sqrt(3 / 0.36)), rel=1e-9)
    assert c.p_value == pytest.approx(0.10409, abs=1e-5)
    half = 1.959963984540054 / math.sqrt(5 - 3)  # z(0.975) / sqrt(n - 3)
    assert (c.low, c.high) == (pytest.approx(math.tanh(math.atanh(0.8) - half), rel=1e-12),
                               pytest.approx(math.tanh(math.atanh(0.8) + half), rel=1e-12))
    assert c.low == pytest.approx(-0.27964, abs=1e-5) and c.high == pytest.approx(0.98620, abs=1e-5)
    assert stats.correlation([1, 2, 3, 4, 5], [-2, -1, -4, -3, -5]).r == pytest.approx(-0.8, abs=1e-15)


def test_correlation_matches_numpy_and_degenerate_cases_are_nan():
    rng = np.random.default_rng(0)
    x = rng.normal(size=30)
    y = 0.5 * x + rng.normal(size=30)
    assert stats.correlation(x.tolist(), y.tolist()).r == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)
    assert math.isnan(stats.correlation([1.0, 2.0], [3.0, 1.0]).r)  # n = 2: no degree of freedom left
    assert math.isnan(stats.correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).r)  # no spread in x
    three = stats.correlation([1.0, 2.0, 3.0], [1.0, 3.0, 2.0])  # r = 0.5 with df 1: a p-value, no Fisher interval
    assert three.r == pytest.approx(0.5) and math.isnan(three.low) and 0 < three.p_value < 1
    with pytest.raises(ValueError, match="one y per x"):
        stats.correlation([1.0, 2.0, 3.0], [1.0, 2.0])


def test_within_groups_takes_each_arms_mean_out_first():
    # Two arms far apart (the second higher in x, lower in y): across arms r is strongly negative; inside each arm
    # dx = -1 0 1, dy = -1 1 0, so the pooled within-arm r = 2 / 4 = 0.5 with one control (df = 6 - 2 - 1 = 3)
    x = [1.0, 2.0, 3.0, 11.0, 12.0, 13.0]
    y = [1.0, 3.0, 2.0, -10.0, -8.0, -9.0]
    groups = ["a", "a", "a", "b", "b", "b"]
    assert stats.correlation(x, y).r == pytest.approx(np.corrcoef(x, y)[0, 1]) and stats.correlation(x, y).r < -0.9
    c = stats.within_groups(x, y, groups)
    assert c.r == pytest.approx(0.5, abs=1e-15) and c.n == 6
    assert c.p_value == pytest.approx(t3_two_sided_p(0.5 * math.sqrt(3 / 0.75)), rel=1e-9)
    half = 1.959963984540054 / math.sqrt(6 - 3 - 1)
    assert c.low == pytest.approx(math.tanh(math.atanh(0.5) - half), rel=1e-12)
    with pytest.raises(ValueError, match="one x, y and group"):
        stats.within_groups(x, y, groups[:5])


def test_a_seed_without_a_value_is_left_out():
    with_gap = stats.mean_interval([0.2, math.nan, 0.4, 0.9])
    assert with_gap == stats.mean_interval([0.2, 0.4, 0.9])
    paired = stats.paired_difference([0.5, 0.7, math.nan, 0.4], [0.1, 0.2, 0.3, math.nan])
    assert paired == stats.mean_interval([0.5 - 0.1, 0.7 - 0.2])
    assert stats.mean_interval([math.nan]).n == 0
