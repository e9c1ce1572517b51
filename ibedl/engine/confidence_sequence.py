"""Confidence sequences for the mean of a stream of [0, 1] outcomes (a label was right, a set covered it, a
question was answered): intervals that hold the mean at every step at once, so they stay valid while someone
watches them after every label and stops whenever they like (a fixed-n interval, e.g. Clopper-Pearson, recomputed
after every label is not: it is crossed eventually by chance).

The construction is testing by betting (Waudby-Smith & Ramdas 2023). For each candidate mean m on a grid, two
gamblers bet on the next outcome x_t: one that it lies above m (wealth K+ multiplies by 1 + l+ (x_t - m) / s), the
other below (K- multiplies by 1 - l- (x_t - m) / s), with s = max(m, 1 - m) so a factor stays in [1/2, 3/2].
The bets l in [0, 1/2] are chosen from the past only, by online Newton steps (Cutkosky & Orabona 2018), which
learn the growth-optimal bet quickly when the outcomes sit far from m and bet ~0 when they do not. If every
outcome's conditional mean is >= m, K- is a non-negative supermartingale from 1 and by Ville's inequality ever
reaches 2/alpha with probability <= alpha/2 (likewise K+ when every conditional mean is <= m). So

- the upper bound is one grid step above the largest m that K- has not ruled out (K-(m) < 2/alpha): the mean is
  above it at some time with probability <= alpha/2 (K- at the grid point below the mean would have crossed);
- the lower bound is one step below the smallest m that K+ has not ruled out, likewise;
- an upper bound below a target t is evidence, valid under continuous monitoring, that the outcomes' conditional
  means are not all >= t: a stated guarantee "mean >= t" is violated (false alarm probability <= alpha/2).

Everything is vectorised over a leading batch shape (independent streams: the benchmarks replay many seeds at
once); the service keeps one stream per (adapter, version, guarantee) with shape ().

References:
    Waudby-Smith, I. & Ramdas, A. (2023). Estimating means of bounded random variables by betting. JRSS B.
    Cutkosky, A. & Orabona, F. (2018). Black-box reductions for parameter-free online learning in Banach spaces.
    Shekhar, S. & Ramdas, A. (2023). Nonparametric two-sample testing by betting. IEEE Trans. Inf. Theory.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

GRID = 1000  # candidate means i / GRID, i = 1..GRID-1: bounds have a resolution of 0.001 and include 0.9 exactly
MAX_BET = 0.5
ONS_STEP = 2.0 / (2.0 - math.log(3.0))  # the online Newton step's constant for bets in [-1/2, 1/2]


class BettingCS:
    """Betting confidence sequence for the mean of [0, 1] outcomes (two one-sided sequences at alpha/2 each), over
    a batch of independent streams.

    Args:
        alpha: the probability, over the whole stream, that the mean ever leaves the sequence (0 < alpha < 1).
        shape: batch shape of independent streams; () for one.
        grid: candidate means are i / grid for i = 1..grid-1.
    """

    def __init__(self, alpha: float, shape: tuple[int, ...] = (), grid: int = GRID) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if grid < 2:
            raise ValueError(f"grid must be >= 2, got {grid}")
        self.alpha = float(alpha)
        self.means = np.arange(1, grid) / grid  # (G,) candidate means
        self._scale = np.maximum(self.means, 1.0 - self.means)  # (G,) s: payoffs (x - m) / s lie in [-1, 1]
        full = (*shape, len(self.means))
        self.log_wealth = np.zeros((2, *full))  # (2, ..., G) log K+ and log K-
        self._bet = np.zeros((2, *full))  # (2, ..., G) the next bets l+ and l-
        self._curvature = np.ones((2, *full))  # (2, ..., G) 1 + sum of squared ONS gradients
        self.n = np.zeros(shape, dtype=np.int64)  # (...) outcomes seen
        self.total = np.zeros(shape)  # (...) their sum

    def update(self, x, active=None) -> None:
        """Add one outcome to every stream.

        Args:
            x: (...) outcomes in [0, 1], one per stream (broadcast to the batch shape).
            active: (...) bool, optional: streams that take this outcome (the others are left as they are).
        """
        x = np.broadcast_to(np.asarray(x, dtype=np.float64), self.n.shape)
        if np.any((x < 0.0) | (x > 1.0)) or not np.all(np.isfinite(x)):
            raise ValueError(f"outcomes must lie in [0, 1], got {x[(x < 0) | (x > 1) | ~np.isfinite(x)][:3]}")
        on = np.ones(self.n.shape, dtype=bool) if active is None else np.broadcast_to(active, self.n.shape)
        payoff = (x[..., None] - self.means) / self._scale  # (..., G) in [-1, 1]
        payoff = np.stack([payoff, -payoff])  # (2, ..., G): K+ wins when x > m, K- when x < m
        factor = 1.0 + self._bet * payoff  # in [1/2, 3/2]
        gradient = payoff / factor  # d/dl log(1 + l payoff)
        curvature = self._curvature + gradient ** 2
        bet = np.clip(self._bet + ONS_STEP * gradient / curvature, 0.0, MAX_BET)
        keep = on[None, ..., None]
        self.log_wealth = np.where(keep, self.log_wealth + np.log(factor), self.log_wealth)
        self._curvature = np.where(keep, curvature, self._curvature)
        self._bet = np.where(keep, bet, self._bet)
        self.n = self.n + on
        self.total = self.total + np.where(on, x, 0.0)

    def state(self) -> bytes:
        """Everything the next outcome and the bounds depend on (the outcomes' count and sum, each gambler's log
        wealth, bet and curvature), as zlib-compressed little-endian float64: ~36 kB for one stream. ``alpha`` is
        not part of it (it only reads the wealth), so a state continues under any ``alpha``."""
        parts = (self.n.astype(np.float64), self.total, self.log_wealth, self._bet, self._curvature)
        return zlib.compress(np.concatenate([np.ravel(p) for p in parts]).astype("<f8").tobytes())

    def restore(self, state: bytes) -> None:
        """Continue from a :meth:`state` of a sequence with the same batch shape and grid: the bounds and every later
        update are those of that sequence, bit for bit (the n outcomes it saw need not be seen again)."""
        values = np.frombuffer(zlib.decompress(state), dtype="<f8")
        streams, full = np.size(self.n), self.log_wealth.size
        if values.size != 2 * streams + 3 * full:
            raise ValueError(f"a state of {values.size} numbers is not one of this sequence (batch shape "
                             f"{np.shape(self.n)}, grid {len(self.means) + 1}: {2 * streams + 3 * full} numbers)")
        n, total, wealth, bet, curvature = np.split(values, np.cumsum([streams, streams, full, full]))
        shape = np.shape(self.n)
        self.n = n.astype(np.int64).reshape(shape)[()]  # [()]: a numpy scalar for one stream, as update leaves it
        self.total = total.reshape(shape).copy()[()]
        self.log_wealth = wealth.reshape(self.log_wealth.shape).copy()
        self._bet = bet.reshape(self._bet.shape).copy()
        self._curvature = curvature.reshape(self._curvature.shape).copy()

    def extend(self, xs) -> None:
        """Add a sequence of outcomes to a single stream (shape ()), in order."""
        for x in xs:
            self.update(x)

    def ruled_out(self, alpha: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(above, below), each (..., G) bool: the candidate means that K+ (the mean is above them) and K- (it
        is below them) have ruled out now, wealth >= 2 / alpha."""
        alpha = self.alpha if alpha is None else alpha
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        level = math.log(2.0 / alpha)
        return self.log_wealth[0] >= level, self.log_wealth[1] >= level

    def bounds(self, alpha: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper), each (...): [0, 1] before any outcome. Each holds the mean at every step with
        probability >= 1 - alpha/2 (both together >= 1 - alpha)."""
        above, below = self.ruled_out(alpha)
        step = 1.0 / (len(self.means) + 1)
        g = len(self.means)
        # the largest candidate K- has not ruled out (index -1: none, the sentinel m = 0) and the smallest K+ has
        # not (index g: none, the sentinel m = 1)
        last = g - 1 - np.argmax(~below[..., ::-1], axis=-1)
        last = np.where((~below).any(axis=-1), last, -1)
        first = np.where((~above).any(axis=-1), np.argmax(~above, axis=-1), g)
        upper = np.minimum((last + 1) * step + step, 1.0)
        lower = np.maximum((first + 1) * step - step, 0.0)
        return lower, upper

    def below_target(self, target: float, alpha: float | None = None) -> np.ndarray:
        """(...) bool: the upper bound is below ``target``: a guarantee "mean >= target" is shown violated."""
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {target}")
        return self.bounds(alpha)[1] < target

    def mean(self) -> np.ndarray:
        """(...) the running mean, NaN before any outcome."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.n > 0, self.total / np.maximum(self.n, 1), np.nan)
