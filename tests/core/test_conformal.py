"""Conformal prediction sets: scores against their closed forms, the quantile's rank, and coverage on
synthetic exchangeable data with 2..26 options."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ibedl.core.conformal import (
    alpha_key,
    calibrate_quantiles,
    conformal_quantile,
    conformal_rank,
    label_scores,
    option_scores,
    prediction_set,
)


class TestScores:
    def test_lac_is_one_minus_probability(self):
        p = [0.5, 0.2, 0.3]
        assert option_scores(p, "lac") == pytest.approx([0.5, 0.8, 0.7])

    def test_aps_is_the_mass_ranked_above_plus_half_its_own(self):
        p = [0.2, 0.5, 0.3]  # ranked B (0.5), C (0.3), A (0.2)
        assert option_scores(p, "aps") == pytest.approx([0.8 + 0.1, 0.25, 0.5 + 0.15])

    def test_label_scores_mix_option_counts(self):
        probs = [[0.7, 0.3], [0.1, 0.2, 0.3, 0.4], [1 / 26] * 26]
        s = label_scores(probs, [1, 3, 25], "lac")
        assert s == pytest.approx([0.7, 0.6, 1 - 1 / 26])

    @pytest.mark.parametrize("bad", [[0.5], [[0.5, 0.5]]])
    def test_one_question_needs_two_options(self, bad):
        with pytest.raises(ValueError, match="C >= 2"):
            option_scores(bad, "lac")

    def test_unknown_score_and_label_outside_options_are_refused(self):
        with pytest.raises(ValueError, match="'raps'"):
            option_scores([0.5, 0.5], "raps")
        with pytest.raises(ValueError, match="label 2 of question 0"):
            label_scores([[0.5, 0.5]], [2], "lac")


class TestQuantile:
    def test_rank_is_ceil_n_plus_one_times_one_minus_alpha(self):
        scores = np.arange(1, 20) / 20  # n = 19
        # ceil(20 * 0.9) = 18 -> the 18th smallest
        assert conformal_quantile(scores, 0.1) == pytest.approx(18 / 20)
        assert conformal_quantile(scores, 0.5) == pytest.approx(10 / 20)

    def test_too_few_scores_for_alpha_give_infinity(self):
        assert math.isinf(conformal_quantile([0.1, 0.2, 0.3], 0.1))  # ceil(4 * 0.9) = 4 > 3

    @pytest.mark.parametrize("alpha", [0, 1, -0.1, True])
    def test_alpha_outside_zero_one_is_refused(self, alpha):
        with pytest.raises(ValueError, match="alpha must be in"):
            conformal_quantile([0.1, 0.2], alpha)

    def test_calibrate_quantiles_writes_none_for_infinity(self):
        q = calibrate_quantiles([[0.9, 0.1]] * 5, [0] * 5, [0.01, 0.5])
        assert q["lac"][alpha_key(0.01)] is None
        assert q["lac"]["0.5"] == pytest.approx(0.1)


class TestSets:
    def test_set_is_options_under_quantile_most_probable_first(self):
        assert prediction_set([0.1, 0.6, 0.3], 0.75, "lac") == [1, 2]
        assert prediction_set([0.1, 0.6, 0.3], 0.8, "aps") == [1, 2]  # scores 0.95, 0.3, 0.75

    def test_never_empty(self):
        assert prediction_set([0.4, 0.35, 0.25], 0.1, "lac") == [0]

    def test_infinite_quantile_keeps_every_option(self):
        assert sorted(prediction_set([0.4, 0.35, 0.25], math.inf, "aps")) == [0, 1, 2]

    @pytest.mark.parametrize("score", ["lac", "aps"])
    @pytest.mark.parametrize("alpha", [0.05, 0.2])
    def test_marginal_coverage_on_exchangeable_data(self, score, alpha):
        """Labels drawn from a known categorical model (2..26 options): averaged over random splits, the true
        answer's score is under the quantile between 1 - alpha and 1 - alpha + 1/(n + 1) of the time (up to
        simulation noise), and the served sets (never empty) cover at least that."""
        rng = np.random.default_rng(0)
        n_cal, n_test, splits = 300, 300, 60
        coverage, exact = [], []
        for _ in range(splits):
            counts = rng.integers(2, 27, size=n_cal + n_test)
            probs = [rng.dirichlet(np.full(c, 0.5)) for c in counts]
            labels = [int(rng.choice(len(p), p=p)) for p in probs]
            q = conformal_quantile(label_scores(probs[:n_cal], labels[:n_cal], score), alpha)
            hits = [y in prediction_set(p, q, score) for p, y in zip(probs[n_cal:], labels[n_cal:], strict=True)]
            coverage.append(np.mean(hits))
            exact.append(np.mean(label_scores(probs[n_cal:], labels[n_cal:], score) <= q))
        noise = 3 * math.sqrt(alpha * (1 - alpha) / (n_test * splits)) + 3 * math.sqrt(alpha / (n_cal * splits))
        assert 1 - alpha - noise <= np.mean(exact) <= 1 - alpha + 1 / (n_cal + 1) + noise
        assert np.mean(coverage) >= np.mean(exact)


class TestTrainingConditional:
    """PAC quantiles (delta given): the served rule's own coverage is >= 1 - alpha in at least 1 - delta of
    calibration draws. With continuous scores the coverage of the k-th smallest of n is Beta(k, n + 1 - k)."""

    @pytest.mark.parametrize(("n", "alpha", "delta"), [(10, 0.1, 0.05), (100, 0.1, 0.05), (700, 0.1, 0.01),
                                                       (700, 0.02, 0.1), (50, 0.3, 0.2)])
    def test_the_rank_is_the_smallest_whose_binomial_tail_is_within_delta(self, n, alpha, delta):
        from scipy.stats import binom

        tail = [float(binom.pmf(np.arange(k, n + 1), n, 1 - alpha).sum()) for k in range(1, n + 2)]  # P(B >= k)
        k = conformal_rank(n, alpha, delta)
        assert (tail[k - 1] <= delta if k <= n else tail[n - 1] > delta) and (k == 1 or tail[k - 2] > delta)
        assert k >= conformal_rank(n, alpha)  # never below the marginal rank

    def test_the_rank_against_brute_force_in_exact_arithmetic(self):
        """Every n from 1 to 60 at three alphas and three deltas: the served k-th smallest score covers less than
        1 - alpha with probability P(U_(k) < 1 - alpha) = P(Binomial(n, 1 - alpha) >= k), summed here term by term
        in rational numbers (no scipy, no floats); the rank is the smallest k (n + 1: none) with that <= delta. An
        off-by-one in either direction fails here, though coverage simulations could not tell it."""
        from fractions import Fraction
        from math import comb

        for alpha in (Fraction(1, 20), Fraction(1, 10), Fraction(1, 5)):
            for delta in (Fraction(1, 100), Fraction(1, 20), Fraction(1, 10)):
                for n in range(1, 61):
                    tail = [sum(comb(n, j) * (1 - alpha) ** j * alpha ** (n - j) for j in range(k, n + 1))
                            for k in range(1, n + 2)]  # tail[k - 1] = P(B >= k); tail[n] = 0
                    brute = next(k for k in range(1, n + 2) if tail[k - 1] <= delta)
                    assert conformal_rank(n, float(alpha), float(delta)) == brute, (n, alpha, delta)
                    # the gate's rank mirrors it: the largest k with P(Binomial(n, alpha) <= k - 1) <= delta
                    lower = [sum(comb(n, j) * alpha ** j * (1 - alpha) ** (n - j) for j in range(k))
                             for k in range(0, n + 1)]  # lower[k] = P(Binomial(n, alpha) <= k - 1)
                    gate = max((k for k in range(1, n + 1) if lower[k] <= delta), default=0)
                    assert n + 1 - conformal_rank(n, float(alpha), float(delta)) == gate, (n, alpha, delta)

    def test_known_ranks_and_the_price_of_delta(self):
        assert conformal_rank(700, 0.1) == 631 and conformal_rank(700, 0.1, 0.05) == 644
        assert conformal_rank(700, 0.1, 0.01) == 649
        assert conformal_rank(10, 0.1, 0.05) == 11 and math.isinf(conformal_quantile(np.arange(10.0), 0.1, 0.05))

    def test_bad_delta_is_refused(self):
        for delta in (0.0, 1.0, -0.1, True):
            with pytest.raises(ValueError, match="delta must be in"):
                conformal_rank(100, 0.1, delta)

    @pytest.mark.parametrize(("n", "alpha", "delta"), [(200, 0.1, 0.05), (700, 0.1, 0.01), (100, 0.2, 0.1)])
    def test_served_coverage_misses_in_at_most_delta_of_draws(self, n, alpha, delta):
        """Scores uniform on (0, 1): a threshold q covers exactly q of new questions. Over 20,000 calibration
        draws the share of served rules below 1 - alpha matches the binomial tail at the chosen rank (<= delta);
        marginal quantiles miss in a large share of draws (about half at n = 700)."""
        from scipy.stats import binom

        rng = np.random.default_rng(0)
        draws = 20_000
        scores = rng.random((draws, n))
        pac = np.array([conformal_quantile(s, alpha, delta) for s in scores[:4000]])
        k = conformal_rank(n, alpha, delta)
        # the same order statistic over all draws, vectorised
        kth = np.partition(scores, k - 1, axis=1)[:, k - 1]
        assert np.array_equal(pac, kth[:4000])
        missed = float(np.mean(kth < 1 - alpha))
        expected = float(binom.sf(k - 1, n, 1 - alpha))  # P(Binomial(n, 1 - alpha) >= k)
        noise = 4 * math.sqrt(expected * (1 - expected) / draws) + 1e-3
        assert abs(missed - expected) <= noise and expected <= delta
        m = conformal_rank(n, alpha)
        marginal_missed = float(np.mean(np.partition(scores, m - 1, axis=1)[:, m - 1] < 1 - alpha))
        assert marginal_missed > 0.3 > delta  # marginal sets are not PAC at this delta

    def test_calibrate_quantiles_stores_the_pac_quantile(self):
        probs = [[0.9, 0.1]] * 50 + [[0.4, 0.6]] * 50
        labels = [0] * 100
        marginal = calibrate_quantiles(probs, labels, [0.3], ["lac"])["lac"]["0.3"]
        pac = calibrate_quantiles(probs, labels, [0.3], ["lac"], delta=0.01)["lac"]["0.3"]
        scores = np.sort(label_scores(probs, labels, "lac"))
        assert marginal == scores[conformal_rank(100, 0.3) - 1] and pac == scores[conformal_rank(100, 0.3, 0.01) - 1]


def test_the_marginal_lac_quantile_is_mapies():
    """MAPIE's LAC score (1 - p of the true option) and its split-conformal quantile (the ceil((n + 1)(1 - alpha))-th
    smallest score) on the same calibration sample equal ours, at several alphas and sizes."""
    from mapie.conformity_scores import LACConformityScore

    rng = np.random.default_rng(4)
    for n in (37, 200, 701):
        probs = rng.dirichlet(np.ones(4), size=n)
        labels = rng.integers(0, 4, n)
        lac = LACConformityScore()
        theirs_scores = lac.get_conformity_scores(labels, probs, labels)[:, 0]
        assert label_scores(list(probs), labels, "lac") == pytest.approx(theirs_scores, abs=1e-15)
        alphas = np.array([0.05, 0.1, 0.2])
        theirs = lac.get_conformity_score_quantiles(theirs_scores, alphas, cv="split")
        ours = [conformal_quantile(label_scores(list(probs), labels, "lac"), a) for a in alphas]
        assert ours == pytest.approx(list(theirs), abs=1e-15)
