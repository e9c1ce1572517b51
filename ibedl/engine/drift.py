"""Drift of served uncertainty against the artifact's validation reference: KS statistic and PSI over a
rolling window, with an alarm threshold calibrated by bootstrap so that a healthy stream rarely alarms.

Calibration: draw a window-sized sample and a reference-sized sample, both with replacement from the
reference, and take their KS statistic; repeat, and set the threshold at the (1 - alarm_rate) quantile.
Drawing both sides mimics what is compared at serve time (a finite window against a finite reference),
so the threshold accounts for the reference's own sampling noise, not only the window's.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

PSI_BINS = 10
PSI_FLOOR = 1e-4


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic sup_x |F_a(x) - F_b(x)| (equals scipy's ks_2samp)."""
    a = np.sort(np.asarray(a, dtype=np.float64))
    b = np.sort(np.asarray(b, dtype=np.float64))
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))


def psi(reference: np.ndarray, window: np.ndarray, bins: int = PSI_BINS) -> float:
    """Population stability index over reference-quantile bins: sum (w - r) ln(w / r)."""
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)))
    if len(edges) < 2:
        return 0.0
    inner = edges[1:-1]
    r = np.bincount(np.searchsorted(inner, reference, side="right"), minlength=len(edges) - 1) / len(reference)
    w = np.bincount(np.searchsorted(inner, window, side="right"), minlength=len(edges) - 1) / len(window)
    r, w = np.maximum(r, PSI_FLOOR), np.maximum(w, PSI_FLOOR)
    return float(np.sum((w - r) * np.log(w / r)))


def bootstrap_threshold(reference: np.ndarray, window_size: int, alarm_rate: float, draws: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    stats = [
        ks_statistic(rng.choice(reference, window_size), rng.choice(reference, len(reference)))
        for _ in range(draws)
    ]
    return float(np.quantile(stats, 1.0 - alarm_rate))


class DriftMonitor:
    """Rolling window of served values compared with a reference sample. Thread-safe.

    The alarm is only raised once the window is full: the threshold is calibrated at that size.
    """

    def __init__(self, reference, statistic: str, window_size: int = 500, alarm_rate: float = 0.01,
                 draws: int = 1000, seed: int = 0) -> None:
        ref = np.asarray([x for x in (reference if reference is not None else []) if x is not None], dtype=np.float64)
        if window_size < 2:
            raise ValueError(f"window_size must be >= 2, got {window_size}")
        self.statistic = statistic
        self.reference = ref
        self.window_size = window_size
        self.window: deque[float] = deque(maxlen=window_size)
        # A reference with no spread (a collapsed adapter answering u = 1.0 everywhere) gives a zero
        # threshold that any served value would cross: drift is not measurable then, so no alarm.
        usable = len(ref) >= 10 and np.ptp(ref) > 0
        self.threshold = bootstrap_threshold(ref, window_size, alarm_rate, draws, seed) if usable else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    def add(self, values) -> None:
        with self._lock:
            self.window.extend(float(v) for v in values if v is not None)

    def status(self) -> dict:
        with self._lock:
            window = np.asarray(self.window, dtype=np.float64)
        ks = p = None
        if self.enabled and len(window) >= 2:
            ks = ks_statistic(window, self.reference)
            p = psi(self.reference, window)
        alarm = bool(ks is not None and len(window) >= self.window_size and ks > self.threshold)
        return {
            "statistic": self.statistic,
            "window": int(len(window)),
            "window_size": self.window_size,
            "reference_size": int(len(self.reference)),
            "ks": ks,
            "psi": p,
            "ks_threshold": self.threshold,
            "alarm": alarm,
            "window_mean": float(window.mean()) if len(window) else None,
            "reference_mean": float(self.reference.mean()) if len(self.reference) else None,
        }


class AccuracyEstimate:
    """Label-free estimate of the accuracy of answered questions over a rolling window (confidence-based
    performance estimation): if the served probabilities are calibrated, a question answered with
    confidence p is right with probability p, so the window's expected accuracy is the mean of p, and the
    realised accuracy spreads around it with variance sum p (1 - p) / m^2 (a Poisson-binomial). Thread-safe.

    It is only as good as the calibration it assumes: under shift calibration breaks, which the OOD gate
    (questions refused) and the drift alarm (u moved) are there to show.
    """

    Z = 1.959964  # two-sided 95%

    def __init__(self, window_size: int = 500, target: float | None = None) -> None:
        if window_size < 2:
            raise ValueError(f"window_size must be >= 2, got {window_size}")
        if target is not None and not 0.0 < target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {target}")
        self.target = target
        self.window: deque[float] = deque(maxlen=window_size)
        self._lock = threading.Lock()

    def add(self, confidences) -> None:
        """Confidences of answered (not abstained) questions."""
        with self._lock:
            self.window.extend(float(c) for c in confidences)

    def status(self) -> dict:
        with self._lock:
            p = np.asarray(self.window, dtype=np.float64)
        if not len(p):
            return {"answered_in_window": 0, "estimated_accuracy": None, "estimated_accuracy_interval": None,
                    "target_accuracy": self.target}
        mean = float(p.mean())
        half = self.Z * float(np.sqrt(np.sum(p * (1.0 - p)))) / len(p)
        return {"answered_in_window": int(len(p)), "estimated_accuracy": mean,
                "estimated_accuracy_interval": [max(0.0, mean - half), min(1.0, mean + half)],
                "target_accuracy": self.target}
