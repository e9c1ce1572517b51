import pytest
import torch
from torch.nn import functional as F

from ibedl.core.head import (
    SAMPLING_SEED,
    SIGMA_FLOOR,
    EvidentialHead,
    HeadConfig,
    IBEDLHead,
    SoftmaxHead,
    adjust_alpha,
    build_head,
    gauss_hermite,
    temper,
)


@pytest.fixture
def hidden():
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def rows():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def mask_for(counts, width):
    m = torch.zeros(len(counts), width, dtype=torch.bool)
    for i, c in enumerate(counts):
        m[i, :c] = True
    return m


class TestSoftmaxHead:
    def test_probs_are_softmax_of_option_rows(self, hidden, rows):
        head = SoftmaxHead(HeadConfig("softmax", 4, 8), rows)
        out = head(hidden, torch.ones(5, 4, dtype=torch.bool))
        torch.testing.assert_close(out.probs, torch.softmax(hidden @ rows.T, -1))
        assert out.alpha is None and out.uncertainty is None

    def test_ragged_batch_equals_single(self, hidden, rows):
        head = SoftmaxHead(HeadConfig("softmax", 4, 8), rows)
        out = head(hidden, mask_for([4, 3, 2, 4, 3], 4))
        single = head(hidden[1:2], torch.ones(1, 3, dtype=torch.bool))
        torch.testing.assert_close(out.probs[1, :3], single.probs[0])
        assert out.probs[1, 3] == 0


class TestEvidentialHead:
    def test_alpha_is_softplus_plus_offset(self, hidden, rows):
        head = EvidentialHead(HeadConfig("evidential", 4, 8, offset=0.1), rows)
        out = head(hidden, torch.ones(5, 4, dtype=torch.bool))
        torch.testing.assert_close(out.alpha, F.softplus(hidden @ rows.T) + 0.1)
        torch.testing.assert_close(out.uncertainty, 4 * 0.1 / out.alpha.sum(-1))

    def test_bias_init_centres_pre_evidence(self, hidden, rows):
        head = EvidentialHead(HeadConfig("evidential", 4, 8), rows * 10 + 17)
        mask = torch.ones(5, 4, dtype=torch.bool)
        head.init_bias_from(hidden, mask)
        assert head.pre_evidence(hidden, mask).mean().item() == pytest.approx(0.0, abs=1e-4)


class TestIBEDLHead:
    def test_mean_inference_is_deterministic_softplus_of_mu(self, hidden, rows):
        head = IBEDLHead(HeadConfig("ib_edl", 4, 8), rows)
        mask = torch.ones(5, 4, dtype=torch.bool)
        a, b = head(hidden, mask), head(hidden, mask)
        torch.testing.assert_close(a.alpha, b.alpha, rtol=0, atol=0)
        torch.testing.assert_close(a.alpha, F.softplus(hidden @ rows.T) + 1)
        torch.testing.assert_close(a.belief.sum(-1) + a.uncertainty, torch.ones(5))

    def test_both_heads_start_from_the_option_rows(self, hidden, rows):
        # The paper: mu and sigma heads both initialised from the pretrained LM head's rows.
        head = IBEDLHead(HeadConfig("ib_edl", 4, 8), rows)
        mu, sigma = head.gaussian(hidden, torch.ones(5, 4, dtype=torch.bool))
        torch.testing.assert_close(mu, hidden @ rows.T)
        torch.testing.assert_close(sigma, F.softplus(hidden @ rows.T) + SIGMA_FLOOR)

    def test_centred_sigma_and_its_bias_from_a_batch(self, hidden, rows):
        mask = mask_for([4, 3, 4, 2, 4], 4)
        head = IBEDLHead(HeadConfig("ib_edl", 4, 8, centre_options=True, centre_sigma=True), rows)
        head.init_bias_from(hidden, mask)
        z = (hidden @ rows.T).masked_fill(~mask, 0.0)
        centred = z - z.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
        assert head.sigma_bias.item() == pytest.approx(0.0, abs=1e-6)  # centred rows average 0 already
        _, sigma = head.gaussian(hidden, mask)
        torch.testing.assert_close(sigma[mask], (F.softplus(centred) + SIGMA_FLOOR)[mask])
        assert (sigma[~mask] == 1.0).all()
        # Uncentred, the bias moves the batch's mean pre-activation to 0.
        plain = IBEDLHead(HeadConfig("ib_edl", 4, 8), rows)
        plain.init_bias_from(hidden, mask)
        assert plain.sigma_bias.item() == pytest.approx(-(z[mask]).mean().item(), rel=1e-5)

    def test_sigma_varies_with_the_question(self, hidden, rows):
        head = IBEDLHead(HeadConfig("ib_edl", 4, 8, centre_options=True, centre_sigma=True), rows)
        mask = torch.ones(5, 4, dtype=torch.bool)
        head.init_bias_from(hidden, mask)
        _, sigma = head.gaussian(hidden, mask)
        assert sigma.median() > 0.1 and sigma.std() / sigma.mean() > 0.1

    def test_quadrature_matches_monte_carlo(self, hidden, rows):
        head = IBEDLHead(HeadConfig("ib_edl", 4, 8, inference="quadrature", quadrature_points=20), rows)
        mu = torch.tensor([[-1.0, 0.0, 2.0]])
        sigma = torch.tensor([[0.5, 1.0, 2.0]])
        eps = torch.randn(400_000, 1, 3, generator=torch.Generator().manual_seed(0))
        mc = F.softplus(mu + sigma * eps).mean(0)
        torch.testing.assert_close(head.expected_evidence(mu, sigma), mc, rtol=5e-3, atol=5e-3)

    def test_sampled_inference_is_the_papers_k_sample_mean_on_one_fixed_table(self, hidden, rows):
        head = IBEDLHead(HeadConfig("ib_edl", 4, 8, inference="sampled", inference_samples=20), rows)
        mu = torch.tensor([[-1.0, 0.0, 2.0], [0.5, 0.5, 0.5]])
        sigma = torch.tensor([[0.5, 1.0, 2.0], [1.0, 1.0, 1.0]])
        eps = torch.randn((20, 26), generator=torch.Generator().manual_seed(SAMPLING_SEED))[:, :3]
        want = F.softplus(mu.unsqueeze(0) + sigma.unsqueeze(0) * eps.unsqueeze(1)).mean(0)  # (K, B, C) -> (B, C)
        torch.testing.assert_close(head.expected_evidence(mu, sigma), want)
        # the same answer alone as in its batch, and on every call
        torch.testing.assert_close(head.expected_evidence(mu[1:], sigma[1:]), want[1:])
        torch.testing.assert_close(head.expected_evidence(mu, sigma), head.expected_evidence(mu, sigma))
        # a K-sample estimate of what quadrature integrates: close at large K, not equal at K = 20
        many = IBEDLHead(HeadConfig("ib_edl", 4, 8, inference="sampled", inference_samples=200_000), rows)
        exact = IBEDLHead(HeadConfig("ib_edl", 4, 8, inference="quadrature", quadrature_points=20), rows)
        torch.testing.assert_close(many.expected_evidence(mu, sigma), exact.expected_evidence(mu, sigma),
                                   rtol=1e-2, atol=1e-2)
        assert not torch.allclose(want, exact.expected_evidence(mu, sigma), rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("bad", [0, -3, 2.5, True])
    def test_sampled_inference_needs_a_positive_count(self, bad):
        with pytest.raises(ValueError, match=f"inference_samples must be an integer >= 1, got {bad!r}"):
            HeadConfig("ib_edl", 4, 8, inference="sampled", inference_samples=bad)
        with pytest.raises(ValueError, match="inference must be one of mean, quadrature, sampled, got 'median'"):
            HeadConfig("ib_edl", 4, 8, inference="median")

    def test_zeta_lowers_alpha_with_floor(self, hidden, rows):
        mask = torch.ones(5, 4, dtype=torch.bool)
        plain = IBEDLHead(HeadConfig("ib_edl", 4, 8), rows)
        shifted = IBEDLHead(HeadConfig("ib_edl", 4, 8, zeta=2.0), rows)
        shifted.load_state_dict(plain.state_dict())
        a, b = plain(hidden, mask), shifted(hidden, mask)
        torch.testing.assert_close(b.alpha, torch.clamp(a.alpha - 2.0 * a.sigma, min=1.0))
        assert (b.uncertainty >= a.uncertainty).all()


def test_gauss_hermite_integrates_polynomials():
    nodes, weights = gauss_hermite(8)
    assert weights.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert (weights * nodes**2).sum().item() == pytest.approx(1.0, abs=1e-5)  # E[eps^2]
    assert (weights * nodes**4).sum().item() == pytest.approx(3.0, abs=1e-4)  # E[eps^4]


class TestConfigChecks:
    def test_bad_values_named(self):
        with pytest.raises(ValueError, match="head kind must be one of .* got 'nope'"):
            HeadConfig("nope", 4, 8)
        with pytest.raises(ValueError, match="num_rows must be in 2..26, got 27"):
            HeadConfig("softmax", 27, 8)
        with pytest.raises(ValueError, match="inference must be one of mean, quadrature, sampled, got 'mode'"):
            HeadConfig("ib_edl", 4, 8, inference="mode")

    def test_rows_shape_checked(self):
        with pytest.raises(ValueError, match=r"rows must have shape \(4, 8\), got \(3, 8\)"):
            build_head(HeadConfig("softmax", 4, 8), torch.zeros(3, 8))

    def test_unknown_key_is_refused(self):
        # Schema version 1's never-read "extra" is dropped by the manifest migration (test_artifact.py).
        config = HeadConfig("ib_edl", 4, 8, zeta=0.5)
        with pytest.raises(TypeError, match="extra"):
            HeadConfig.from_dict({**config.to_dict(), "extra": {}})

    def test_committed_artifacts_still_load(self):
        from pathlib import Path

        from ibedl.core.artifact import check_artifact

        for name in ("default", "map"):
            manifest = check_artifact(Path(__file__).resolve().parents[2] / "artifacts" / name)
            assert manifest.head_config().num_rows == len(manifest.option_token_ids)

    def test_too_many_options(self, hidden, rows):
        head = SoftmaxHead(HeadConfig("softmax", 4, 8), rows)
        with pytest.raises(ValueError, match="at most 4 options, got 5"):
            head(hidden, torch.ones(5, 5, dtype=torch.bool))


class TestCentredOptions:
    """centre_options: pre-evidence keeps only how the options differ (per question, over its real options)."""

    @pytest.mark.parametrize("kind", ["evidential", "ib_edl"])
    def test_a_shift_shared_by_every_row_changes_nothing(self, kind, hidden, rows):
        mask = mask_for([4, 3, 2, 4, 3], 4)
        shared = torch.randn(8, generator=torch.Generator().manual_seed(2)) * 5
        outs = {}
        for centre in (False, True):
            config = HeadConfig(kind, 4, 8, centre_options=centre)
            plain, shifted = build_head(config, rows)(hidden, mask), build_head(config, rows + shared)(hidden, mask)
            outs[centre] = (plain, shifted)
        torch.testing.assert_close(outs[True][0].alpha, outs[True][1].alpha)
        torch.testing.assert_close(outs[True][0].uncertainty, outs[True][1].uncertainty)
        assert not torch.allclose(outs[False][0].alpha, outs[False][1].alpha)  # the paper's head moves

    def test_pre_evidence_is_centred_over_real_options_then_biased(self, hidden, rows):
        head = EvidentialHead(HeadConfig("evidential", 4, 8, centre_options=True), rows)
        head.set_bias(0.7)
        mask = mask_for([4, 3, 2, 4, 3], 4)
        z = head.pre_evidence(hidden, mask)
        raw = hidden @ rows.T
        for i, c in enumerate([4, 3, 2, 4, 3]):
            torch.testing.assert_close(z[i, :c], raw[i, :c] - raw[i, :c].mean() + 0.7)
            assert (z[i, c:] == 0).all()
        assert head.init_bias_from(hidden, mask) == pytest.approx(0.0, abs=1e-6)  # already centred

    def test_ib_edl_centres_mu_not_sigma(self, hidden, rows):
        mask = mask_for([4, 3, 2, 4, 3], 4)
        plain = IBEDLHead(HeadConfig("ib_edl", 4, 8), rows).gaussian(hidden, mask)
        centred = IBEDLHead(HeadConfig("ib_edl", 4, 8, centre_options=True), rows).gaussian(hidden, mask)
        torch.testing.assert_close(centred[1], plain[1])
        real = mask.float()
        means = (centred[0] * real).sum(-1) / real.sum(-1)
        torch.testing.assert_close(means, torch.zeros(5), atol=1e-5, rtol=0)


class TestEvidenceScale:
    """evidence_scale s: pre-evidence = s * centred(W h) + b in the evidential heads; softmax heads ignore it."""

    @pytest.mark.parametrize("centre", [False, True])
    def test_pre_evidence_is_scaled_before_the_bias(self, centre, hidden, rows):
        head = EvidentialHead(HeadConfig("evidential", 4, 8, centre_options=centre, evidence_scale=3.0), rows)
        head.set_bias(-0.4)
        counts = [4, 3, 2, 4, 3]
        z = head.pre_evidence(hidden, mask_for(counts, 4))
        raw = hidden @ rows.T
        for i, c in enumerate(counts):
            term = raw[i, :c] - raw[i, :c].mean() if centre else raw[i, :c]
            torch.testing.assert_close(z[i, :c], 3.0 * term - 0.4)
            assert (z[i, c:] == 0).all()

    def test_bias_init_centres_the_scaled_pre_evidence(self, hidden, rows):
        mask = mask_for([4, 3, 2, 4, 3], 4)
        head = EvidentialHead(HeadConfig("evidential", 4, 8, evidence_scale=5.0), rows)
        bias = head.init_bias_from(hidden, mask)
        assert bias == pytest.approx(-5.0 * (hidden @ rows.T)[mask].mean().item(), rel=1e-5)
        assert head.pre_evidence(hidden, mask)[mask].mean().item() == pytest.approx(0.0, abs=1e-5)

    def test_ib_edl_scales_mu_not_sigma(self, hidden, rows):
        mask = mask_for([4, 3, 2, 4, 3], 4)
        plain = IBEDLHead(HeadConfig("ib_edl", 4, 8), rows).gaussian(hidden, mask)
        scaled = IBEDLHead(HeadConfig("ib_edl", 4, 8, evidence_scale=2.5), rows).gaussian(hidden, mask)
        torch.testing.assert_close(scaled[0], 2.5 * plain[0])
        torch.testing.assert_close(scaled[1], plain[1])

    @pytest.mark.parametrize("scale", [1.0, 3.4])
    def test_sensitivity_at_zero_is_scaled_closed_form(self, scale):
        # At W h = 0 with bias 0: alpha_j = 1 + ln 2, S = C (1 + ln 2), and
        # dp_y / d(W h)_y = s * softplus'(0) * (S - alpha_y) / S^2 = s * 0.5 * (C - 1) / (C^2 (1 + ln 2)).
        c = 4
        head = EvidentialHead(HeadConfig("evidential", c, 8, evidence_scale=scale), torch.eye(c, 8))
        hidden = torch.zeros(1, 8, requires_grad=True)
        head(hidden, torch.ones(1, c, dtype=torch.bool)).probs[0, 0].backward()
        expected = scale * 0.5 * (c - 1) / (c**2 * (1 + torch.log(torch.tensor(2.0)).item()))
        assert hidden.grad[0, 0].item() == pytest.approx(expected, rel=1e-5)
        assert expected / scale == pytest.approx(0.0554, abs=1e-4)  # against 0.1875 for a softmax

    def test_softmax_head_ignores_it(self, hidden, rows):
        mask = mask_for([4, 3, 2, 4, 3], 4)
        plain = SoftmaxHead(HeadConfig("softmax", 4, 8), rows)(hidden, mask)
        scaled = SoftmaxHead(HeadConfig("softmax", 4, 8, evidence_scale=7.0), rows)(hidden, mask)
        torch.testing.assert_close(scaled.probs, plain.probs)

    @pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "4"])
    def test_bad_scale_named(self, bad):
        with pytest.raises(ValueError, match="evidence_scale must be a finite number > 0, got"):
            HeadConfig("evidential", 4, 8, evidence_scale=bad)


class TestPosthocMaps:
    """The heads' post-hoc maps, which the forward pass, the predictor and calibration all use."""

    def test_posthoc_keys_by_kind(self):
        assert HeadConfig("ib_edl", 4, 8).posthoc_key == "zeta"
        assert HeadConfig("softmax", 4, 8).posthoc_key == "temperature"
        assert HeadConfig("evidential", 4, 8).posthoc_key is None

    def test_zeta_map_closed_form(self):
        alpha = torch.tensor([[3.0, 1.5, 1.2]], dtype=torch.float64)
        sigma = torch.tensor([[1.0, 0.25, 0.5]], dtype=torch.float64)
        # max(alpha - 1 * sigma, 1): [2, 1.25, max(0.7, 1) = 1]; zeta -2 raises every option by 2 sigma.
        out = adjust_alpha(alpha, sigma, 1.0, 1.0)
        assert out.dtype == torch.float64 and out.tolist() == [[2.0, 1.25, 1.0]]
        assert adjust_alpha(alpha, sigma, -2.0, 1.0).tolist() == [[5.0, 2.0, 2.2]]
        assert adjust_alpha(alpha, sigma, 0.0, 1.0) is alpha
        config = HeadConfig("ib_edl", 4, 8, offset=1.0, zeta=1.0)
        assert config.posthoc_alpha(alpha, sigma).tolist() == [[2.0, 1.25, 1.0]]
        assert config.posthoc_alpha(alpha, sigma, zeta=0.5).tolist() == [[2.5, 1.375, 1.0]]

    def test_temperature_map_closed_form(self):
        # softmax(log p / 2) = sqrt(p) normalised: [0.64, 0.16, 0.2 (padded)] -> [0.8, 0.4] / 1.2.
        probs = torch.tensor([[0.64, 0.16, 0.2]], dtype=torch.float64)
        mask = torch.tensor([[True, True, False]])
        out = temper(probs, mask, 2.0)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, torch.tensor([[2 / 3, 1 / 3, 0.0]], dtype=torch.float64))
        assert temper(probs, mask, 1.0) is probs
        config = HeadConfig("softmax", 4, 8, temperature=2.0)
        torch.testing.assert_close(config.posthoc_probs(probs.float(), mask), out.float())

    def test_ib_edl_forward_applies_its_config_map(self, hidden, rows):
        mask = mask_for([4, 3, 2, 4, 3], 4)
        head = IBEDLHead(HeadConfig("ib_edl", 4, 8), rows)
        raw = head(hidden, mask)
        head.config.zeta = 0.75
        out = head(hidden, mask)
        expected = head.config.posthoc_alpha(raw.alpha, raw.sigma).masked_fill(~mask, 0.0)
        torch.testing.assert_close(out.alpha, expected)
        torch.testing.assert_close(out.probs, expected / expected.sum(-1, keepdim=True))
