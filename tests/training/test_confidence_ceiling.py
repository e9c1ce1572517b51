"""The confidence ceiling against scipy's optimiser on the full vector, and the NLL risk's stationarity
conditions in closed form."""

from itertools import pairwise

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from ibedl.training.confidence_ceiling import confidence_ceiling, main, objective


def scipy_ceiling(beta: float, num_options: int, risk: str) -> float:
    """Minimise over all C pre-evidences (no symmetry assumed) from an asymmetric start."""

    def f(x):
        mu = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        value = objective(mu.unsqueeze(0), beta, risk).sum()
        value.backward()
        return value.item(), mu.grad.numpy().copy()

    start = np.linspace(2.0, -2.0, num_options)
    res = minimize(f, start, jac=True, method="BFGS", options={"gtol": 1e-11, "maxiter": 10_000})
    alpha = np.log1p(np.exp(res.x)) + 1.0
    return alpha[0] / alpha.sum()


@pytest.mark.parametrize("risk", ["mse", "nll"])
@pytest.mark.parametrize("beta,num_options", [(1e-2, 4), (1e-3, 4), (1e-4, 5), (1e-5, 3), (1e-3, 2)])
def test_matches_scipy_on_the_full_vector(risk, beta, num_options):
    ours = confidence_ceiling(beta, num_options, risk)
    assert ours.confidence == pytest.approx(scipy_ceiling(beta, num_options, risk), abs=1e-5)


@pytest.mark.parametrize("beta", [1e-2, 1e-3, 1e-5])
def test_nll_stationarity_in_closed_form(beta):
    # f = log alpha0 - log alpha_y + beta/2 |mu|^2, alpha = softplus(mu) + 1, d softplus = sigmoid:
    #   correct: sigmoid(mu_y) (1/alpha0 - 1/alpha_y) + beta mu_y = 0
    #   other:   sigmoid(mu_o) / alpha0 + beta mu_o = 0
    c = confidence_ceiling(beta, 4, "nll")
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    alpha_y = np.log1p(np.exp(c.mu_correct)) + 1
    a0 = c.strength
    assert sig(c.mu_correct) * (1 / a0 - 1 / alpha_y) + beta * c.mu_correct == pytest.approx(0, abs=1e-9)
    assert sig(c.mu_other) / a0 + beta * c.mu_other == pytest.approx(0, abs=1e-9)
    assert c.confidence == pytest.approx(alpha_y / a0, rel=1e-12)


@pytest.mark.parametrize("risk", ["mse", "nll"])
def test_ceiling_rises_as_beta_falls_and_more_options_lower_it(risk):
    values = [confidence_ceiling(b, 4, risk).confidence for b in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)]
    assert all(a < b for a, b in pairwise(values))
    assert values[0] > 0.25 and values[-1] < 1.0
    assert confidence_ceiling(1e-3, 5, risk).confidence < confidence_ceiling(1e-3, 3, risk).confidence


@pytest.mark.parametrize("kwargs,needle", [
    ({"beta": 0.0}, "beta must be"), ({"beta": float("nan")}, "nan"), ({"beta": 1e-3, "num_options": 1}, "got 1"),
    ({"beta": 1e-3, "risk": "ce"}, "'ce'"),
])
def test_bad_arguments_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        confidence_ceiling(**kwargs)


def test_cli_prints_a_row_per_risk_and_beta(capsys):
    assert main(["--beta", "1e-3", "1e-4", "--options", "4", "--risk", "mse"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[1].split()[:2] == ["mse", "1e-03"]
    assert float(lines[1].split()[2]) == pytest.approx(confidence_ceiling(1e-3, 4, "mse").confidence, abs=1e-4)
    assert main(["--beta", "-1"]) == 2
    assert "beta must be" in capsys.readouterr().err
