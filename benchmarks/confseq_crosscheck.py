"""The realised guarantees' confidence sequence (ibedl.engine.confidence_sequence.BettingCS) beside a maintained
implementation of the same construction, confseq's hedged betting CS (Waudby-Smith & Ramdas 2023; the package of
its authors' group), on the same streams:

    python -m venv /tmp/confseq && /tmp/confseq/bin/pip install scikit-build cmake pybind11 "numpy<2" scipy \
        matplotlib multiprocess pandas pytest && apt-get install libboost-dev && \
        /tmp/confseq/bin/pip install --no-build-isolation confseq==0.0.11
    PYTHONPATH=. /tmp/confseq/bin/python -m benchmarks.confseq_crosscheck [--streams 200] [--length 2000]

(confseq is not in the lock: it builds C++ against Boost and pins numpy < 2.) Streams of 0/1 outcomes at a true
mean, as a guarantee's labels are: per mean, the share of streams whose sequence ever excludes the true mean (both
must stay below alpha), and the upper bound after 100, 300, 1,000 and all labels (lower is sharper); at a true mean
below the stated 0.9, the labels each needs before its upper bound falls below 0.9 (the alert's detection delay).
Writes ``benchmarks/results/confseq_crosscheck.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks.common import write_result
from ibedl.engine.confidence_sequence import BettingCS

CHECKPOINTS = (100, 300, 1000)
STATED = 0.9


def ours(x: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) after every outcome of each stream: x is (S, T)."""
    cs = BettingCS(alpha, (x.shape[0],))
    lower, upper = np.empty(x.shape), np.empty(x.shape)
    for t in range(x.shape[1]):
        cs.update(x[:, t])
        lower[:, t], upper[:, t] = cs.bounds()
    return lower, upper


def theirs(x: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    from confseq.betting import hedged_cs

    out = [hedged_cs(row, alpha=alpha, breaks=1000, running_intersection=False) for row in x]
    return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


def first_below(upper: np.ndarray, level: float) -> np.ndarray:
    below = upper < level
    return np.where(below.any(1), below.argmax(1) + 1, -1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.confseq_crosscheck",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--alpha", type=float, default=0.03, help="IBEDL_GUARANTEE_ALPHA's default")
    parser.add_argument("--output", default="benchmarks/results/confseq_crosscheck.json")
    args = parser.parse_args(argv)
    import confseq

    rng = np.random.default_rng(0)
    result = {"command": "python -m benchmarks.confseq_crosscheck " + " ".join(argv or sys.argv[1:]),
              "confseq": getattr(confseq, "__version__", "0.0.11"), "construction": "confseq.betting.hedged_cs",
              "streams": args.streams, "length": args.length, "alpha": args.alpha, "means": {}}
    for mean in (0.95, 0.9, 0.8, 0.6):
        x = (rng.random((args.streams, args.length)) < mean).astype(float)
        row = {}
        for name, build in (("ibedl", ours), ("confseq", theirs)):
            start = time.perf_counter()
            lower, upper = build(x, args.alpha)
            missed = ((lower > mean) | (upper < mean)).any(1)
            detect = first_below(upper, STATED)
            row[name] = {
                "ever_excludes_true_mean": float(missed.mean()),
                "upper_mean_at": {str(t): float(upper[:, t - 1].mean())
                                  for t in (*CHECKPOINTS, args.length) if t <= args.length},
                "alarm_share": float((detect > 0).mean()),
                "labels_to_alarm_median": float(np.median(detect[detect > 0])) if (detect > 0).any() else None,
                "seconds": round(time.perf_counter() - start, 1),
            }
        result["means"][str(mean)] = row
        print(mean, row, file=sys.stderr, flush=True)
    write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
