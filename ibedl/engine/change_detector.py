"""A change detector for a stated guarantee "the mean of these [0, 1] outcomes is >= t" whose detection delay does not
grow with the history: a mixture Shiryaev-Roberts e-detector (Shin, Ramdas & Rinaldo 2024, "E-detectors: a
nonparametric framework for sequential change detection"), beside the confidence sequences
(ibedl.engine.confidence_sequence) that say whether the promise held since the version started.

For each alternative mean rho_j < t on a small grid, an outcome x in [0, 1] gets the e-value

    e_j(x) = a_j + b_j x,  a_j = (1 - rho_j) / (1 - t),  b_j = rho_j / t - a_j  (< 0),

which is the likelihood ratio Bernoulli(rho_j) : Bernoulli(t) for x in {0, 1} (a right answer, a covering set),
non-negative on [0, 1], and has E[e_j(x)] = a_j + b_j E[x] <= 1 whenever E[x] >= t: while the promise holds, every
product of e-values is a non-negative supermartingale. The Shiryaev-Roberts statistic of alternative j sums the
products that start at every past outcome,

    R_j(n) = (R_j(n - 1) + 1) e_j(x_n),   R_j(0) = 0,

and the detector's statistic is their mean M(n) = mean_j R_j(n). While every conditional mean is >= t, M(n) - n is
a supermartingale from 0, so for any horizon N, P(M(n) >= A for some n <= N) <= N / A (Ville's inequality on
M(n) - n + N). An alarm at threshold A = N / eps therefore has false-alarm probability <= eps within N outcomes,
whatever happened before: the statistic forgets a long healthy history (it stays near its floor while the mean is
above t), so the delay after a change is about log(A) / KL(rho || t) outcomes at any age, where the cumulative
sequences need more evidence the more history they hold.

At an alarm, the change point estimate is where the CUSUM of the best alternative last restarted (the start of the
run of outcomes that most favours a change), kept beside the statistic: C_j(n) = max(C_j(n - 1), 1) e_j(x_n).

Once a stream has alarmed its statistics stop moving (its outcomes are still counted): the alarm and the change
point are decided, and a statistic that kept multiplying e-values of up to 1 / (1 - t) per miss would overflow to
infinity within a few hundred misses.

Everything is vectorised over a leading batch shape, like ibedl.engine.confidence_sequence.BettingCS.
"""

from __future__ import annotations

import zlib

import numpy as np

DROPS = (0.05, 0.1, 0.2, 0.3, 0.45)  # alternatives rho_j = t - drop (those above 0)
FROZEN_CAP = 1e300  # a restored statistic that overflowed (an earlier release's alarmed stream): finite, its mean too


class ChangeDetector:
    """Mixture Shiryaev-Roberts e-detector of a drop of the mean of [0, 1] outcomes below ``target``, over a batch of
    independent streams.

    Args:
        target: the stated level t in (0, 1).
        threshold: the alarm level A > 1 of the mean statistic: P(false alarm within N outcomes) <= N / A.
        shape: batch shape of independent streams; () for one.
        drops: the alternatives t - drop (those > 0).
    """

    def __init__(self, target: float, threshold: float, shape: tuple[int, ...] = (),
                 drops: tuple[float, ...] = DROPS) -> None:
        if not 0.0 < target < 1.0:
            raise ValueError(f"target must be in (0, 1), got {target}")
        if not threshold > 1.0:
            raise ValueError(f"threshold must be > 1, got {threshold}")
        rho = np.asarray([target - d for d in drops if target - d > 0.0])
        if rho.size == 0:
            raise ValueError(f"no alternative below target {target} among drops {drops}")
        self.target, self.threshold, self.alternatives = float(target), float(threshold), rho
        self._a = (1.0 - rho) / (1.0 - target)  # (J,)
        self._b = rho / target - self._a  # (J,) < 0
        full = (*shape, len(rho))
        self.sr = np.zeros(full)  # (..., J) Shiryaev-Roberts statistic per alternative
        self.cusum = np.zeros(full)  # (..., J) CUSUM per alternative
        self.start = np.zeros(full)  # (..., J) the mark (default: 1-based index) where each CUSUM last restarted
        self.n = np.zeros(shape, dtype=np.int64)  # (...) outcomes seen
        self.alarm_at = np.zeros(shape, dtype=np.int64)  # (...) the outcome at which it first alarmed (0: never)
        self.change_at = np.zeros(shape, dtype=np.int64)  # (...) the change point's mark estimated then (0: none)

    def update(self, x, active=None, mark=None) -> None:
        """Add one outcome to every stream.

        Args:
            x: (...) outcomes in [0, 1], one per stream (broadcast to the batch shape).
            active: (...) bool, optional: streams that take this outcome (the others are left as they are).
            mark: (...) the outcome's own index elsewhere (e.g. a store's label sequence number), what the change
                point is reported in; default its 1-based index in the stream.
        """
        x = np.broadcast_to(np.asarray(x, dtype=np.float64), self.n.shape)
        if np.any((x < 0.0) | (x > 1.0)) or not np.all(np.isfinite(x)):
            raise ValueError(f"outcomes must lie in [0, 1], got {x[(x < 0) | (x > 1) | ~np.isfinite(x)][:3]}")
        on = np.ones(self.n.shape, dtype=bool) if active is None else np.broadcast_to(active, self.n.shape)
        moving = on & (self.alarm_at == 0)  # an alarmed stream counts its outcomes, its statistics stay as alarmed
        keep = moving[..., None]
        n = self.n + on
        mark = n if mark is None else np.broadcast_to(np.asarray(mark, dtype=np.float64), self.n.shape)
        e = self._a + self._b * x[..., None]  # (..., J)
        restart = self.cusum < 1.0
        self.sr = np.where(keep, (self.sr + 1.0) * e, self.sr)
        self.cusum = np.where(keep, np.maximum(self.cusum, 1.0) * e, self.cusum)
        self.start = np.where(keep & restart, np.asarray(mark, dtype=np.float64)[..., None], self.start)
        self.n = n
        fired = moving & (self.statistic() >= self.threshold)
        best = np.take_along_axis(self.start, np.argmax(self.cusum, axis=-1)[..., None], axis=-1)[..., 0]
        self.change_at = np.where(fired, best.astype(np.int64), self.change_at)
        self.alarm_at = np.where(fired, self.n, self.alarm_at)

    def statistic(self) -> np.ndarray:
        """(...) the mixture statistic M(n) = mean_j R_j(n)."""
        return self.sr.mean(axis=-1)

    def alarmed(self) -> np.ndarray:
        """(...) bool: the statistic has reached the threshold at some outcome (an alarm stays raised)."""
        return self.alarm_at > 0

    def state(self) -> bytes:
        """Everything later updates and the alarm depend on, as zlib-compressed little-endian float64 (the
        threshold and alternatives are settings, not state)."""
        parts = (self.n.astype(np.float64), self.alarm_at.astype(np.float64), self.change_at.astype(np.float64),
                 self.sr, self.cusum, self.start)
        return zlib.compress(np.concatenate([np.ravel(p) for p in parts]).astype("<f8").tobytes())

    def restore(self, state: bytes) -> None:
        """Continue from a :meth:`state` of a detector with the same batch shape and alternatives."""
        values = np.frombuffer(zlib.decompress(state), dtype="<f8")
        streams, full = np.size(self.n), self.sr.size
        if values.size != 3 * streams + 3 * full:
            raise ValueError(f"a state of {values.size} numbers is not one of this detector (batch shape "
                             f"{np.shape(self.n)}, {self.sr.shape[-1]} alternatives)")
        n, alarm, change, sr, cusum, start = np.split(values, np.cumsum([streams, streams, streams, full, full]))
        shape = np.shape(self.n)
        self.n = n.astype(np.int64).reshape(shape)[()]
        self.alarm_at = alarm.astype(np.int64).reshape(shape)[()]
        self.change_at = change.astype(np.int64).reshape(shape)[()]
        # an earlier release let an alarmed stream's statistics overflow to inf; they stay frozen from here on
        self.sr = np.nan_to_num(sr.reshape(self.sr.shape), posinf=FROZEN_CAP)
        self.cusum = np.nan_to_num(cusum.reshape(self.cusum.shape), posinf=FROZEN_CAP)
        self.start = start.reshape(self.start.shape).copy()


def alarm_threshold(horizon: int, false_alarm: float, series: int = 1) -> float:
    """The threshold A at which ``series`` detectors, fed ``horizon`` outcomes in all (any split among them), raise a
    false alarm with probability <= ``false_alarm`` over those outcomes: each detector with n_i outcomes alarms
    falsely with probability <= n_i / A, so the union is <= series x horizon / A when each outcome may reach every
    series (a label updates one option count's detector per guarantee)."""
    if horizon < 1 or series < 1:
        raise ValueError(f"horizon and series must be >= 1, got {horizon} and {series}")
    if not 0.0 < false_alarm < 1.0:
        raise ValueError(f"false_alarm must be in (0, 1), got {false_alarm}")
    return series * horizon / false_alarm


__all__ = ["ChangeDetector", "alarm_threshold", "DROPS"]
