"""The option-count report's checks: what a test of m questions measures of a rule set at the k-th smallest of n
exchangeable scores (its level ~ Beta(k, n + 1 - k), then binomial noise: BetaBinomial), the promise's own side
(Binomial at the stated level), and the one-sided binomial test of answered accuracy."""

import numpy as np
from scipy.stats import beta

from benchmarks.option_counts import beta_binomial_quantile, checks


def test_a_huge_test_measures_the_beta_quantiles_of_the_rule_s_level():
    k, n = 649, 700
    lo, hi = (beta_binomial_quantile(q, 1_000_000, k, n) for q in (0.01, 0.99))
    assert abs(lo - beta.ppf(0.01, k, n + 1 - k)) < 2e-3 and abs(hi - beta.ppf(0.99, k, n + 1 - k)) < 2e-3


def test_the_beta_binomial_quantiles_are_a_simulation_s():
    """Against a simulation of the two stages: the level drawn from Beta(k, n + 1 - k), then Binomial(m, level)."""
    rng = np.random.default_rng(0)
    k, n, m = 649, 700, 1000
    simulated = rng.binomial(m, rng.beta(k, n + 1 - k, 400_000)) / m
    for q in (0.005, 0.5, 0.995):
        assert abs(beta_binomial_quantile(q, m, k, n) - np.quantile(simulated, q)) <= 0.0015


def test_a_rank_past_n_is_every_option():
    assert beta_binomial_quantile(0.99, 1000, 701, 700) == 1.0


def row(**changes) -> dict:
    return {"questions": 1000, "answered": 0.5, "answered_accuracy": 0.93, "target_accuracy": 0.9,
            "set_coverage": 0.93, "gate_refused": 0.1, "gate_stated_rate": 0.15, **changes}


def test_the_checks_pass_what_the_promises_allow_and_refuse_the_rest():
    ranks = (31, 300, 649, 700, 0.1)  # gate rank and n, set rank and n, alpha
    good = checks(row(), *ranks, family=5)
    assert good["answered_accuracy_not_below_target"] and good["set_coverage_in_range"]
    assert good["gate_refused_in_range"]
    # 440 right of 500 answered (0.88): a binomial test at 0.9 rejects it at 0.2% (0.02 over 5 counts, one side)
    assert not checks(row(answered_accuracy=0.85), *ranks, family=5)["answered_accuracy_not_below_target"]
    assert not checks(row(set_coverage=0.86), *ranks, family=5)["set_coverage_in_range"]  # below the promise
    assert not checks(row(set_coverage=0.99), *ranks, family=5)["set_coverage_in_range"]  # above the rank's law
    assert not checks(row(gate_refused=0.25), *ranks, family=5)["gate_refused_in_range"]  # above the promise
    low, high = good["gate_refused_range"]
    assert low < 31 / 301 < 0.15 < high


def test_more_counts_widen_each_range():
    ranks = (31, 300, 649, 700, 0.1)
    one, five = checks(row(), *ranks, family=1), checks(row(), *ranks, family=5)
    assert five["set_coverage_range"][0] <= one["set_coverage_range"][0]
    assert five["set_coverage_range"][1] >= one["set_coverage_range"][1]


def test_a_missing_artifact_or_scores_is_one_line(tmp_path, capsys):
    from benchmarks.option_counts import main

    assert main(["score", "--artifact", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "manifest.json not found" in err and "Traceback" not in err
