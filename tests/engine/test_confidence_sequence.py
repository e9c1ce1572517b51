"""The betting confidence sequence: its wealth against a plain scalar re-implementation, coverage under
continuous monitoring by simulation (fixed seeds), nesting in alpha, and its power after a shift."""

import math

import numpy as np
import pytest

from ibedl.engine.confidence_sequence import BettingCS


def reference_log_wealth(xs, m: float) -> tuple[float, float]:
    """log K+ and log K- at one candidate mean, written out as the docstring states (scalar loop, no numpy)."""
    s = max(m, 1.0 - m)
    step = 2.0 / (2.0 - math.log(3.0))
    out = []
    for sign in (1.0, -1.0):
        log_k, bet, curvature = 0.0, 0.0, 1.0
        for x in xs:
            payoff = sign * (x - m) / s
            factor = 1.0 + bet * payoff
            log_k += math.log(factor)
            gradient = payoff / factor
            curvature += gradient * gradient
            bet = min(max(bet + step * gradient / curvature, 0.0), 0.5)
        out.append(log_k)
    return out[0], out[1]


class TestWealth:
    def test_matches_a_scalar_reference(self):
        rng = np.random.default_rng(3)
        xs = list(rng.random(300) < 0.7) + list(rng.random(100))  # binary, then fractional outcomes
        cs = BettingCS(0.05, grid=20)
        cs.extend(xs)
        for i in (0, 4, 13, 18):
            up, down = reference_log_wealth([float(x) for x in xs], cs.means[i])
            assert cs.log_wealth[0, i] == pytest.approx(up, rel=1e-10, abs=1e-10)
            assert cs.log_wealth[1, i] == pytest.approx(down, rel=1e-10, abs=1e-10)
        assert cs.n == len(xs) and cs.mean() == pytest.approx(np.mean(xs))

    def test_batched_streams_equal_separate_ones(self):
        rng = np.random.default_rng(5)
        xs = (rng.random((50, 3)) < [0.2, 0.5, 0.9]).astype(float)
        batch = BettingCS(0.1, (3,), grid=50)
        for row in xs:
            batch.update(row)
        for j in range(3):
            one = BettingCS(0.1, grid=50)
            one.extend(xs[:, j])
            np.testing.assert_allclose(batch.log_wealth[:, j], one.log_wealth, rtol=1e-12)

    def test_inactive_streams_are_untouched(self):
        cs = BettingCS(0.1, (2,), grid=10)
        cs.update([1.0, 0.0], active=[True, False])
        assert cs.n.tolist() == [1, 0] and np.all(cs.log_wealth[:, 1] == 0.0)

    def test_bad_arguments_are_refused_with_the_value(self):
        with pytest.raises(ValueError, match="alpha must be in"):
            BettingCS(1.5)
        with pytest.raises(ValueError, match=r"outcomes must lie in \[0, 1\]"):
            BettingCS(0.1).update(1.2)
        with pytest.raises(ValueError, match="target must be in"):
            BettingCS(0.1).below_target(0.0)


class TestBounds:
    def test_before_any_outcome_everything_is_possible(self):
        lower, upper = BettingCS(0.05).bounds()
        assert lower == 0.0 and upper == 1.0

    @pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.97])
    def test_coverage_under_continuous_monitoring(self, p):
        """Over 400 Bernoulli(p) streams of 600 outcomes, checked after every outcome, the share of streams whose
        interval ever misses p is at most alpha (0.1) plus three Monte Carlo standard errors."""
        alpha, streams = 0.1, 400
        rng = np.random.default_rng(int(p * 1000))
        cs = BettingCS(alpha, (streams,), grid=100)
        missed = np.zeros(streams, dtype=bool)
        for _ in range(600):
            cs.update(rng.random(streams) < p)
            lower, upper = cs.bounds()
            missed |= (lower > p) | (upper < p)
        assert missed.mean() <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / streams), missed.mean()
        assert np.all(upper - lower < 0.3)  # and it does narrow

    def test_smaller_alpha_gives_a_wider_interval_at_every_step(self):
        rng = np.random.default_rng(11)
        cs = BettingCS(0.05, grid=200)
        for x in rng.random(400) < 0.8:
            cs.update(x)
            wide, narrow = cs.bounds(0.01), cs.bounds(0.2)
            assert wide[0] <= cs.bounds()[0] <= narrow[0] and narrow[1] <= cs.bounds()[1] <= wide[1]

    def test_interval_narrows_roughly_like_one_over_root_n(self):
        rng = np.random.default_rng(2)
        cs = BettingCS(0.05, (100,), grid=200)
        widths = {}
        for t in range(1, 1601):
            cs.update(rng.random(100) < 0.5)
            if t in (100, 1600):
                lower, upper = cs.bounds()
                widths[t] = float(np.mean(upper - lower))
        # 16x the data: about 1/4 the width (log factors make it a little more)
        assert 0.2 < widths[1600] / widths[100] < 0.4, widths


class TestGuaranteeCheck:
    def test_a_met_guarantee_rarely_alarms(self):
        """Mean exactly at the target (the hardest case under the null): alarm within 2,000 outcomes in at
        most alpha/2 of 300 streams plus three standard errors."""
        alpha, streams = 0.1, 300
        rng = np.random.default_rng(7)
        cs = BettingCS(alpha, (streams,), grid=100)
        alarmed = np.zeros(streams, dtype=bool)
        for _ in range(2000):
            cs.update(rng.random(streams) < 0.9)
            alarmed |= cs.below_target(0.9)
        assert alarmed.mean() <= alpha / 2 + 3 * math.sqrt(alpha / 2 * (1 - alpha / 2) / streams), alarmed.mean()

    def test_a_violated_guarantee_is_found_quickly_after_a_good_history(self):
        """500 outcomes at 0.95, then 0.6 against a target of 0.9: found within 150 outcomes in every stream."""
        rng = np.random.default_rng(8)
        cs = BettingCS(0.05, (100,), grid=100)
        for _ in range(500):
            cs.update(rng.random(100) < 0.95)
        assert not cs.below_target(0.9).any()
        for _ in range(150):
            cs.update(rng.random(100) < 0.6)
        assert cs.below_target(0.9).all()


class TestState:
    """What the feedback store's checkpoint keeps: a sequence restored from its state is the sequence, bit for bit,
    under any alpha (the state holds the wealth, not a verdict)."""

    @pytest.mark.parametrize("shape", [(), (3,)])
    def test_a_restored_sequence_continues_bit_for_bit(self, shape):
        rng = np.random.default_rng(3)
        seen = BettingCS(0.05, shape)
        for _ in range(200):
            seen.update(rng.random(shape) < 0.8)
        restored = BettingCS(0.01, shape)  # another alpha: the bounds at 0.05 are still the same
        restored.restore(seen.state())
        for _ in range(50):
            x = rng.random(shape) < 0.6
            seen.update(x)
            restored.update(x)
        assert np.array_equal(restored.log_wealth, seen.log_wealth) and np.array_equal(restored.n, seen.n)
        assert np.array_equal(restored.bounds(0.05), seen.bounds()) and np.array_equal(restored.total, seen.total)
        assert type(restored.n) is type(seen.n)  # a numpy scalar for one stream, an array for a batch

    def test_a_state_is_compact(self):
        cs = BettingCS(0.05)
        cs.extend(np.random.default_rng(0).random(1000) < 0.9)
        assert len(cs.state()) < 40_000  # 3 x 2 x 999 float64 (48 kB) before compression

    def test_a_state_of_another_sequence_is_refused(self):
        with pytest.raises(ValueError, match="not one of this sequence.*grid 1000"):
            BettingCS(0.05).restore(BettingCS(0.05, grid=100).state())
