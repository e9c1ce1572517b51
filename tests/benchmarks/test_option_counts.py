"""The option-count report's prediction of what a test measures: the k-th smallest of n exchangeable scores puts the
served rule's level at Beta(k, n + 1 - k), and a test of m questions adds binomial noise."""

import numpy as np
from scipy.stats import beta

from benchmarks.option_counts import predicted


def test_a_huge_test_measures_the_beta_quantiles_of_the_rule_s_level():
    k, n = 649, 700
    lo, hi = predicted(k, n, m=10_000_000, draws=400_000)
    assert abs(lo - beta.ppf(0.01, k, n + 1 - k)) < 2e-3 and abs(hi - beta.ppf(0.99, k, n + 1 - k)) < 2e-3


def test_a_small_test_widens_the_interval_around_the_expected_level():
    wide, narrow = predicted(649, 700, m=100), predicted(649, 700, m=100_000)
    assert wide[0] < narrow[0] < 649 / 701 < narrow[1] < wide[1]


def test_a_rank_past_n_is_every_option():
    assert predicted(701, 700, m=1000) == [1.0, 1.0]


def test_it_is_seeded():
    assert predicted(45, 300, 1000) == predicted(45, 300, 1000) and np.isfinite(predicted(45, 300, 1000)).all()
