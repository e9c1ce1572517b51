"""Plots for evaluation reports: reliability diagrams and risk-coverage curves, written as PNG."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: reports are files
import matplotlib.pyplot as plt  # noqa: E402

from ibedl.training import metrics  # noqa: E402


def reliability_diagram(probs, labels, path: str | Path, num_bins: int = 15, title: str = "") -> Path:
    """Accuracy against confidence per bin, with bar widths by bin and the ECE in the legend."""
    rel = metrics.reliability(probs, labels, num_bins)
    edges = rel["edges"]
    centres = [(a + b) / 2 for a, b in pairwise(edges)]
    width = 1.0 / num_bins
    fig, (ax, axc) = plt.subplots(2, 1, figsize=(4.5, 5.5), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    acc = [a if a is not None else 0.0 for a in rel["accuracy"]]
    conf = [c if c is not None else m for c, m in zip(rel["confidence"], centres, strict=True)]
    ax.bar(centres, acc, width=width, edgecolor="black", color="#4C72B0", label="accuracy")
    gap = [c - a for c, a in zip(conf, acc, strict=True)]
    ax.bar(centres, gap, bottom=acc, width=width, color="#DD8452", alpha=0.5,
           edgecolor="#DD8452", label="gap to confidence")
    ax.plot([0, 1], [0, 1], "k--", linewidth=1)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title}\nECE({num_bins}) = {metrics.ece(probs, labels, num_bins):.3f}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    axc.bar(centres, rel["count"], width=width, color="grey", edgecolor="black")
    axc.set_xlabel("confidence (max probability)")
    axc.set_ylabel("count")
    axc.set_xlim(0, 1)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def risk_coverage_plot(curves: dict[str, tuple], path: str | Path, title: str = "") -> Path:
    """One risk-coverage curve per label: ``curves[label] = (scores, hits)``."""
    fig, ax = plt.subplots(figsize=(5, 4))
    for label, (scores, hits) in curves.items():
        cov, risk = metrics.risk_coverage(scores, hits)
        ax.plot(cov, risk, label=f"{label} (AURC {risk.mean():.3f})")
    ax.set_xlabel("coverage")
    ax.set_ylabel("selective risk")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def score_distributions(streams: dict[str, dict[str, list[float]]], path: str | Path, title: str = "") -> Path:
    """One panel per OOD score, one box per stream: ``streams[stream][score]`` holds the score of each question
    (higher: more in-distribution), the in-distribution stream first. A score missing from a stream is left out
    of its panel."""
    if not streams:
        raise ValueError("score_distributions needs at least one stream")
    names = list(dict.fromkeys(s for scores in streams.values() for s in scores))
    if not names:
        raise ValueError(f"no scores in the streams {list(streams)}")
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        shown = {stream: scores[name] for stream, scores in streams.items() if scores.get(name) is not None}
        ax.boxplot(list(shown.values()), showfliers=False)
        ax.set_xticks(range(1, len(shown) + 1), list(shown), rotation=45, ha="right", fontsize=7)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)
