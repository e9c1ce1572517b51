import math

import pytest
import torch
from torch.distributions import Dirichlet, Normal, kl_divergence

from ibedl.training.losses import (
    annealing,
    cross_entropy,
    digamma_ce_risk,
    edl_kl_regulariser,
    gaussian_information,
    ib_edl_risk,
    mse_bayes_risk,
    one_hot,
    sample_pre_evidence,
    vid_loss,
)

N_MC = 400_000


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    alpha = torch.rand(4, 4, generator=g) * 6 + 1.0
    y = torch.tensor([0, 3, 1, 2])
    mask = torch.ones(4, 4, dtype=torch.bool)
    return alpha, y, mask


class TestBayesRisks:
    def test_mse_against_monte_carlo(self, batch):
        alpha, y, mask = batch
        torch.manual_seed(0)
        pi = Dirichlet(alpha.double()).sample((N_MC,))  # (N, B, C)
        target = one_hot(y, mask).double()
        mc = ((target - pi) ** 2).sum(-1).mean(0)
        torch.testing.assert_close(mse_bayes_risk(alpha, y, mask).double(), mc, rtol=3e-3, atol=3e-3)

    def test_mse_variance_term_is_dirichlet_variance(self, batch):
        # (alpha0 + 1) in the denominator, not the (alpha_j + 1) that the paper prints
        alpha, y, mask = batch
        a0 = alpha.sum(-1, keepdim=True)
        var = (alpha * (a0 - alpha) / (a0**2 * (a0 + 1))).sum(-1)
        no_var = mse_bayes_risk(alpha, y, mask, variance=False)
        torch.testing.assert_close(mse_bayes_risk(alpha, y, mask) - no_var, var)

    def test_digamma_ce_against_monte_carlo(self, batch):
        alpha, y, mask = batch
        torch.manual_seed(0)
        pi = Dirichlet(alpha.double()).sample((N_MC,))
        mc = -torch.log(pi.gather(2, y.view(1, -1, 1).expand(N_MC, -1, 1)).squeeze(-1)).mean(0)
        torch.testing.assert_close(digamma_ce_risk(alpha, y, mask).double(), mc, rtol=5e-3, atol=5e-3)

    def test_masked_option_is_ignored(self, batch):
        alpha, y, mask = batch
        mask = mask.clone()
        mask[0, 3] = False
        padded = alpha.clone()
        padded[0, 3] = 1e6  # would dominate if it leaked into any sum
        ref = mse_bayes_risk(alpha[:1, :3], y[:1], torch.ones(1, 3, dtype=torch.bool))
        torch.testing.assert_close(mse_bayes_risk(padded, y, mask)[0], ref[0])
        ref_ce = digamma_ce_risk(alpha[:1, :3], y[:1], torch.ones(1, 3, dtype=torch.bool))
        torch.testing.assert_close(digamma_ce_risk(padded, y, mask)[0], ref_ce[0])

    def test_targets_outside_options_rejected(self, batch):
        alpha, _, mask = batch
        with pytest.raises(ValueError, match="outside the real options"):
            mse_bayes_risk(alpha, torch.tensor([0, 4, 1, 2]), mask)


class TestRegularisers:
    def test_edl_kl_removes_target_evidence(self, batch):
        alpha, y, mask = batch
        tilde = alpha.clone()
        tilde[torch.arange(4), y] = 1.0
        ref = kl_divergence(Dirichlet(tilde.double()), Dirichlet(torch.ones(4, 4).double())).float()
        torch.testing.assert_close(edl_kl_regulariser(alpha, y, mask), ref, rtol=1e-4, atol=1e-4)

    def test_information_term_is_exact_gaussian_kl(self):
        g = torch.Generator().manual_seed(2)
        mu = torch.randn(3, 4, generator=g) * 2
        sigma = torch.rand(3, 4, generator=g) * 2 + 0.05
        mask = torch.ones(3, 4, dtype=torch.bool)
        ref = kl_divergence(Normal(mu.double(), sigma.double()), Normal(0.0, 1.0)).sum(-1).float()
        torch.testing.assert_close(gaussian_information(mu, sigma, mask), ref)

    def test_information_term_masked_and_guarded(self):
        mu = torch.tensor([[0.0, 5.0]])
        sigma = torch.tensor([[1.0, 0.0]])  # sigma 0 on a padded entry must not make -log(0)
        mask = torch.tensor([[True, False]])
        assert gaussian_information(mu, sigma, mask).item() == pytest.approx(0.0, abs=1e-7)
        assert torch.isfinite(gaussian_information(mu, sigma, torch.ones_like(mask))).all()

    def test_vid_prior_uses_stop_gradient(self, batch):
        alpha, y, mask = batch
        alpha = alpha.clone().requires_grad_(True)
        loss = vid_loss(alpha, y, mask)
        target = one_hot(y, mask)
        prior = target * alpha.detach() + (1 - target)
        ref = digamma_ce_risk(alpha, y, mask) + kl_divergence(Dirichlet(alpha), Dirichlet(prior))
        torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
        loss.sum().backward()
        assert torch.isfinite(alpha.grad).all()

    def test_annealing_is_per_epoch_as_the_reference_code(self):
        # min(1, epoch / num_epochs) set at each epoch's start: 0 through the first epoch.
        assert [annealing(e, 4) for e in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
        assert annealing(1, 2, lam=2.0) == 1.0
        with pytest.raises(ValueError, match="-1"):
            annealing(1, 2, -1)
        with pytest.raises(ValueError, match="epochs must be > 0, got 0"):
            annealing(1, 0)


class TestIBEDLRisk:
    def test_sigma_zero_limit_is_mse_of_mean(self, batch):
        _, y, mask = batch
        mu = torch.randn(4, 4)
        sigma = torch.full((4, 4), 1e-6)
        alpha = torch.nn.functional.softplus(mu) + 1
        torch.testing.assert_close(ib_edl_risk(mu, sigma, y, mask, 5), mse_bayes_risk(alpha, y, mask), rtol=1e-4,
                                   atol=1e-5)

    def test_is_monte_carlo_mean_over_samples(self, batch):
        _, y, mask = batch
        mu = torch.randn(4, 4)
        sigma = torch.rand(4, 4) + 0.5
        gen = torch.Generator().manual_seed(3)
        risk = ib_edl_risk(mu, sigma, y, mask, 7, gen)
        gen = torch.Generator().manual_seed(3)
        samples = sample_pre_evidence(mu, sigma, 7, gen)
        ref = torch.stack([mse_bayes_risk(torch.nn.functional.softplus(s) + 1, y, mask) for s in samples]).mean(0)
        torch.testing.assert_close(risk, ref)

    def test_gradients_reach_mu_and_sigma(self, batch):
        _, y, mask = batch
        mu = torch.randn(4, 4, requires_grad=True)
        sigma = (torch.rand(4, 4) + 0.2).requires_grad_(True)
        ib_edl_risk(mu, sigma, y, mask, 20).sum().backward()
        assert mu.grad.abs().sum() > 0 and sigma.grad.abs().sum() > 0


def test_cross_entropy_matches_log_softmax():
    z = torch.tensor([[2.0, 1.0, 0.0, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    expected = -(2.0 - math.log(math.exp(2) + math.exp(1) + 1))
    assert cross_entropy(z, torch.tensor([0]), mask).item() == pytest.approx(expected, rel=1e-6)


class TestBaselineLosses:
    def test_fisher_mse_against_hand_computation(self, batch):
        from ibedl.training.losses import fisher_mse

        alpha, y, mask = batch
        risk, log_det = fisher_mse(alpha, y, mask)
        a = alpha.double()
        a0 = a.sum(-1, keepdim=True)
        p = a / a0
        t = torch.nn.functional.one_hot(y, 4).double()
        tri = torch.polygamma(1, a)
        expected = (tri * ((t - p) ** 2 + p * (1 - p) / (a0 + 1))).sum(-1)
        torch.testing.assert_close(risk.double(), expected, rtol=1e-5, atol=1e-6)
        # log det of the Dirichlet Fisher information diag(psi1(a)) - psi1(a0) 11^T, by linear algebra
        fim = torch.diag_embed(tri) - torch.polygamma(1, a0).unsqueeze(-1) * torch.ones(4, 4, dtype=torch.float64)
        torch.testing.assert_close(log_det.double(), torch.logdet(fim), rtol=1e-4, atol=1e-4)

    def test_relaxed_mse_has_no_variance_term(self, batch):
        from ibedl.training.losses import relaxed_mse

        alpha, y, mask = batch
        p = alpha / alpha.sum(-1, keepdim=True)
        t = torch.nn.functional.one_hot(y, 4).float()
        torch.testing.assert_close(relaxed_mse(alpha, y, mask), ((t - p) ** 2).sum(-1))

    def test_wrong_evidence_kl_with_eta_prior(self, batch):
        from ibedl.training.losses import wrong_evidence_kl

        alpha, y, mask = batch
        tilde = alpha.clone()
        tilde[torch.arange(4), y] = 0.1
        ref = kl_divergence(Dirichlet(tilde.double()), Dirichlet(torch.full((4, 4), 0.1).double())).float()
        torch.testing.assert_close(wrong_evidence_kl(alpha, y, mask, 0.1), ref, rtol=1e-4, atol=1e-4)

    def test_nll_risk_of_ib_edl(self, batch):
        from ibedl.training.losses import dirichlet_mean_nll

        alpha, y, mask = batch
        p = alpha / alpha.sum(-1, keepdim=True)
        torch.testing.assert_close(dirichlet_mean_nll(alpha, y, mask), -torch.log(p[torch.arange(4), y]))
        with pytest.raises(ValueError, match="risk must be one of"):
            ib_edl_risk(torch.zeros(4, 4), torch.ones(4, 4), y, mask, 2, risk="bogus")
