import pytest
import torch
from torch.distributions import Dirichlet, kl_divergence

from ibedl.core.dirichlet import alpha_from_logits, dirichlet_kl, dirichlet_outputs, masked_softmax, strength


@pytest.fixture
def alpha():
    g = torch.Generator().manual_seed(0)
    return torch.rand(6, 5, generator=g) * 10 + 1


class TestBeliefMasses:
    def test_sum_to_one(self, alpha):
        out = dirichlet_outputs(alpha)
        torch.testing.assert_close(out.belief.sum(-1) + out.uncertainty, torch.ones(6))

    def test_probs_are_belief_plus_share_of_uncertainty(self, alpha):
        out = dirichlet_outputs(alpha)
        torch.testing.assert_close(out.probs, out.belief + out.uncertainty[:, None] / 5)

    def test_closed_forms(self):
        alpha = torch.tensor([[2.0, 3.0, 5.0]])
        out = dirichlet_outputs(alpha)
        torch.testing.assert_close(out.probs, torch.tensor([[0.2, 0.3, 0.5]]))
        torch.testing.assert_close(out.belief, torch.tensor([[0.1, 0.2, 0.4]]))
        torch.testing.assert_close(out.uncertainty, torch.tensor([0.3]))
        torch.testing.assert_close(strength(alpha), torch.tensor([10.0]))

    def test_offset_eta(self):
        # R-EDL: alpha = e + eta, u = C * eta / alpha0, beliefs still sum with u to 1
        alpha = torch.tensor([[0.6, 1.1, 2.1]])
        out = dirichlet_outputs(alpha, offset=0.1)
        torch.testing.assert_close(out.uncertainty, torch.tensor([0.3 / 3.8]))
        torch.testing.assert_close(out.belief.sum(-1) + out.uncertainty, torch.ones(1))

    def test_mask_matches_unpadded(self, alpha):
        mask = torch.ones(6, 5, dtype=torch.bool)
        mask[0, 3:] = False
        out = dirichlet_outputs(alpha, mask)
        ref = dirichlet_outputs(alpha[:1, :3])
        torch.testing.assert_close(out.probs[0, :3], ref.probs[0])
        torch.testing.assert_close(out.uncertainty[0], ref.uncertainty[0])
        assert out.probs[0, 3:].abs().sum() == 0
        assert out.belief[0, 3:].abs().sum() == 0

    def test_bfloat16_input_computes_in_float32(self, alpha):
        out = dirichlet_outputs(alpha.bfloat16())
        assert out.probs.dtype == torch.float32

    def test_mask_shape_checked(self, alpha):
        with pytest.raises(ValueError, match="mask shape"):
            dirichlet_outputs(alpha, torch.ones(6, 4, dtype=torch.bool))


def test_alpha_from_logits_is_softplus_plus_one():
    z = torch.tensor([[-30.0, 0.0, 30.0]])
    torch.testing.assert_close(alpha_from_logits(z), torch.tensor([[1.0, 1.0 + 0.6931472, 31.0]]))
    with pytest.raises(ValueError, match="offset must be > 0, got 0"):
        alpha_from_logits(z, 0)


def test_masked_softmax_ignores_padding():
    z = torch.tensor([[1.0, 2.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(masked_softmax(z, mask)[0, :2], torch.softmax(z[0, :2], -1))
    assert masked_softmax(z, mask)[0, 2] == 0


class TestDirichletKL:
    def test_against_torch_distributions(self, alpha):
        beta = alpha.flip(0) * 0.7 + 0.5
        ref = kl_divergence(Dirichlet(alpha.double()), Dirichlet(beta.double())).float()
        torch.testing.assert_close(dirichlet_kl(alpha, beta), ref, rtol=1e-4, atol=1e-4)

    def test_masked_rows_equal_unpadded(self, alpha):
        beta = torch.ones_like(alpha)
        mask = torch.ones_like(alpha, dtype=torch.bool)
        mask[2, 4] = False
        ref = kl_divergence(Dirichlet(alpha[2, :4].double()), Dirichlet(beta[2, :4].double())).float()
        torch.testing.assert_close(dirichlet_kl(alpha, beta, mask)[2], ref, rtol=1e-4, atol=1e-4)

    def test_zero_for_equal(self, alpha):
        torch.testing.assert_close(dirichlet_kl(alpha, alpha), torch.zeros(6), atol=1e-4, rtol=0)
