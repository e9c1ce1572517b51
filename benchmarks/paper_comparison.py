"""The nine-method grid's tables beside the paper's own numbers, generated into docs/results.md.

    python -m benchmarks.paper_comparison [--grid sciq_grid|sciq_grid_paper|sciq_grid_shared_lr] [--results PATH.json]
        [--first-results PATH.json] [--intervals PATH.json] [--efficiency benchmarks/results/method_efficiency.json]
        [--paper PATH.tex]
        [--sigma-heads TRAINED.json FROZEN.json] [--docs docs/results.md] [--check]

Our numbers come from the grid's results file (mean ± std over the seeds it holds) and the per-method cost
benchmark (``python -m benchmarks.method_efficiency``, ratios to MAP); the paper's are read from its LaTeX source
(``$IBEDL_PAPER``, by default ``<repo root>/../shared/paper/ib-edl-iclr2025.tex``): the SciQ column of Tables 1-2
(calibration, Llama2-7B and Llama3-8B), the appendix's full label-noise tables for the same models, Table 3 (OOD
detection, OBQA as in-distribution) and the appendix's cost table (Llama3-8B on OBQA). Each table is written between
the markers ``<!-- begin generated: paper-comparison NAME -->`` and ``<!-- end generated: paper-comparison NAME -->``
in the docs page, so the prose around them stays hand-written and the numbers cannot drift from the committed
results; ``--check`` exits 1 when the page is not what the results and the paper give (tests/benchmarks runs it).

Three grids (``--grid``, see ``GRIDS``): ``sciq_grid`` (early stopping, benchmarks/sciq_grid.yaml; blocks named
``NAME``, with the cost table and the sigma ablation), ``sciq_grid_paper`` (a fixed budget with per-family learning
rates, benchmarks/sciq_grid_paper.yaml) and ``sciq_grid_shared_lr`` (the same budget, one learning rate for every
method); the last two fill blocks named ``<grid>/NAME``: training, id, ood, noise, and claims: the paper's claims about
IB-EDL under each grid up to this one (the first from ``--first-results``), by paired interval where the grid's
intervals exist (``--intervals``: python -m benchmarks.grid_intervals, on its kept predictions), with a ``regime``
block then (is MAP over-confident under the budget?). A grid with no
results file, or an empty one, fills its blocks with a line that says so, and ``--check`` says so too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import REPO
from ibedl.training.experiments.report import (
    NO_POSTHOC,
    dataset_name,
    mean_std,
    method_label,
    method_metrics,
    method_order,
    sigma_table,
    training_table,
)
from ibedl.training.methods import METHODS

PAPER_ENV = "IBEDL_PAPER"
MODELS = ("Llama2-7B", "Llama3-8B")
# the paper's tables this page reads, by LaTeX label: (experiment, model)
TABLES = {"tab:id_llama2_7b": ("id", "Llama2-7B"), "tab:id_llama3_8b": ("id", "Llama3-8B"),
          "tab:full_noisy_llama2_7b": ("noise", "Llama2-7B"), "tab:full_noisy_llama3_8b": ("noise", "Llama3-8B"),
          "tab:ood_llama2_7b_llama3_8b": ("ood", None), "tab:train_test_consumption": ("cost", "Llama3-8B")}
PAPER_METRICS = {"Acc": "accuracy", "ECE": "ece", "NLL": "nll"}
LABELS = {spec.label: name for name, spec in METHODS.items()}
CELL = re.compile(r"\\ms\{(-?[\d.]+)\}\{([\d.]+)\}(?:\[[bu]\])?|\$-\$")
ROW = re.compile(r"&\s*(" + "|".join(re.escape(label) for label in LABELS) + r")\s*&(.*?)\\\\")
# the cost table's rows start with the method, e.g. ``MCD (10 forwards) & \ms{9.79}{1.21} & - & - \\``
COST_ROW = re.compile(r"^\s*(" + "|".join(re.escape(label) for label in LABELS) + r")(?: \([^)]*\))?\s*&(.*?)\\\\")
COST_COLUMNS = ("test_samples_per_s", "train_samples_per_s", "train_memory_gb")  # the paper's column order
BLOCK = re.compile(r"\\multirow\{\d+\}\{\*\}\{([A-Za-z0-9-]+)")
# grid -> the prefix of its blocks' marker names; the first grid's blocks keep their bare names
GRIDS = {"sciq_grid": "", "sciq_grid_paper": "sciq_grid_paper/", "sciq_grid_shared_lr": "sciq_grid_shared_lr/"}
GRID_BLOCKS = ("training", "id", "ood", "noise")  # the blocks a grid other than the first has
# grids whose per-question predictions are kept (benchmarks.grid_predictions): their claims carry paired intervals
# (benchmarks.grid_intervals) and a regime block says whether MAP is over-confident under their budget
KEPT_PREDICTIONS = ("sciq_grid_shared_lr",)
# how the regime block names a grid's MAP runs, and the regime checks beside it: MAP alone under another rate or
# budget (benchmarks/<check>.yaml; results, and intervals where kept, under benchmarks/results/)
REGIME_LABELS = {"sciq_grid_shared_lr": "1e-3, 10 epochs"}
REGIME_CHECKS = {"sciq_grid_shared_lr": {"sciq_regime_check_3ep": "1e-3, 3 epochs",
                                         "sciq_regime_check": "3e-3, 3 epochs"}}
# arms run on their own config beside a grid (benchmarks/<arm>.yaml, some methods on the grid's questions): each is a
# claims column of its own from its intervals against the grid (python -m benchmarks.grid_intervals --grid ARM
# --against GRID: its rows in place of the grid's)
ARMS = {"sciq_grid_shared_lr": {"sciq_grid_shared_lr_paper_ibedl": "one rate for all, IB-EDL as the paper specifies "
                                                                   "it"}}
# the regime each grid measures, as its claims column is headed (what differs between them: benchmarks/<grid>.yaml)
GRID_COLUMNS = {"sciq_grid": "early stopping, per-family rates",
                "sciq_grid_paper": "fixed budget, per-family rates",
                "sciq_grid_shared_lr": "fixed budget, one rate for all"}


def default_paper() -> Path:
    """``$IBEDL_PAPER`` if set, else the paper beside the checkout (``../shared/paper``)."""
    return Path(os.environ.get(PAPER_ENV) or REPO.parent / "shared" / "paper" / "ib-edl-iclr2025.tex")


def _cells(text: str) -> list[tuple[float, float] | None]:
    """``\\ms{mean}{std}`` cells of one table row, ``$-$`` as None."""
    return [(float(m.group(1)), float(m.group(2))) if m.group(1) else None for m in CELL.finditer(text)]


def parse_paper(tex: str) -> dict:
    """The paper's numbers from its LaTeX source.

    Returns:
        ``{"id"|"noise": {model: {method: {"accuracy"|"ece"|"nll": (mean, std)}}}`` for the SciQ column, and
        ``{"ood": {model: {method: {target: {"mp": (mean, std), "um": (mean, std) | None}}}}}`` for OBQA -> target,
        ``{"cost": {method: {"test_samples_per_s"|"train_samples_per_s"|"train_memory_gb": (mean, std) | None}}}``;
        percentages as printed (x100), methods by this project's names (``ib_edl``).
    Raises:
        ValueError: a table this page needs is missing or has no SciQ column.
    """
    out: dict = {"id": {}, "noise": {}, "ood": {}, "cost": {}}
    tables = re.findall(r"\\begin\{table\}(.*?)\\end\{table\}", tex, flags=re.S)
    found = set()
    for table in tables:
        label = re.search(r"\\label\{([^}]*)\}", table)
        if not label or label.group(1) not in TABLES:
            continue
        experiment, model = TABLES[label.group(1)]
        found.add(label.group(1))
        if experiment == "cost":
            for line in table.splitlines():
                if row := COST_ROW.search(line):
                    cells = [next(iter(_cells(c)), None) for c in row.group(2).split("&")]
                    out["cost"][LABELS[row.group(1)]] = dict(zip(COST_COLUMNS, cells, strict=False))
            continue
        if experiment == "ood":
            targets = re.findall(r"\{OBQA \$\\rightarrow\$ ([A-Za-z-]+)\}", table)
            block = None
            for line in table.splitlines():
                if m := BLOCK.search(line):
                    block = m.group(1)
                if (row := ROW.search(line)) and block in MODELS:
                    cells = _cells(row.group(2))
                    out["ood"].setdefault(block, {})[LABELS[row.group(1)]] = {
                        t: {"mp": cells[2 * i], "um": cells[2 * i + 1]} for i, t in enumerate(targets)}
            continue
        header = next((line for line in table.splitlines() if "Method" in line and "SciQ" in line), None)
        if header is None:
            raise ValueError(f"table {label.group(1)} has no SciQ column")
        column = [c.strip() for c in header.split("&")][2:].index("SciQ")
        metric = None
        for line in table.splitlines():
            if (m := BLOCK.search(line)) and m.group(1) in PAPER_METRICS:
                metric = PAPER_METRICS[m.group(1)]
            if (row := ROW.search(line)) and metric:
                out[experiment].setdefault(model, {}).setdefault(LABELS[row.group(1)], {})[metric] = \
                    _cells(row.group(2))[column]
    missing = sorted(set(TABLES) - found)
    if missing:
        raise ValueError(f"the paper's source has no table labelled {missing}")
    return out


def _values(results: list[dict], kind: str, method: str, key: str) -> tuple[list[int], list[float]]:
    """Seeds and finite values of ``key`` over the ``kind`` runs of ``method`` (a ``<method>:no_posthoc`` row reads
    the metrics without the post-hoc step, as the report does)."""
    pairs = sorted((r["seed"], float(m[key])) for name, r, m in method_metrics(results, kind)
                   if name == method and m.get(key) is not None and np.isfinite(m[key]))
    return [seed for seed, _ in pairs], [value for _, value in pairs]


def _ours(values: list[float], scale: float, digits: int) -> str:
    return mean_std(values, scale, digits)[1] if values else "–"


def _paper(cells: dict | None, keys=("accuracy", "ece", "nll")) -> str:
    if not cells:
        return ""
    return " / ".join("–" if cells.get(k) is None else f"{cells[k][0]:.2f}" for k in keys)


def _methods(results: list[dict], kind: str) -> list[str]:
    """Registry order; where a run measured a method without its post-hoc step (IB-EDL at ζ = 0, as the paper runs
    it), that row first and the row with the post-hoc step after it."""
    found = {name for name, _, _ in method_metrics(results, kind)}
    order = method_order(found)
    for m in [m for m in order if m.endswith(NO_POSTHOC)]:
        base = _bare(m)
        order.remove(m)
        order.insert(order.index(base), m)
    return order


def _bare(method: str) -> str:
    """The method of a row: ``ib_edl`` for ``ib_edl:no_posthoc``."""
    return method[: -len(NO_POSTHOC)] if method.endswith(NO_POSTHOC) else method


def _label(method: str, methods: list[str]) -> str:
    """The row's label: a method measured both ways is the paper's row as itself (``IB-EDL (ζ = 0)``) and, with
    its post-hoc step, ``IB-EDL + post-hoc ζ``."""
    if method.endswith(NO_POSTHOC):
        return f"{method_label(_bare(method))} (ζ = 0)"
    return f"{method_label(method)} + post-hoc ζ" if method + NO_POSTHOC in methods else method_label(method)


def _paper_row(method: str, methods: list[str]) -> str | None:
    """The paper's method whose numbers sit beside this row: the no-post-hoc row of a method measured both ways
    (the paper's IB-EDL has no ζ), else the method itself."""
    if method.endswith(NO_POSTHOC):
        return _bare(method)
    return None if method + NO_POSTHOC in methods else method


def _seeds(results: list[dict], kind: str, method: str) -> str:
    seeds, _ = _values(results, kind, method, "accuracy")
    return ",".join(str(s) for s in seeds) or "–"


def calibration_table(results: list[dict], kind: str, paper: dict, selective: bool) -> list[str]:
    """Ours (Acc, ECE, NLL and, with ``selective``, AURC and accuracy at 80% coverage) beside the paper's SciQ
    Acc / ECE / NLL for both models."""
    cols = [("accuracy", "Acc (%)", 100, 2), ("ece", "ECE (%)", 100, 2), ("nll", "NLL", 1, 2)]
    if selective:
        cols += [("aurc", "AURC", 1, 3), ("acc@80", "Acc@80% cov (%)", 100, 2)]
    head = ["Method", "seeds", *(c[1] for c in cols), *(f"paper {m} Acc / ECE / NLL" for m in MODELS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    methods = _methods(results, kind)
    for method in methods:
        ours = [_ours(_values(results, kind, method, key)[1], scale, digits) for key, _, scale, digits in cols]
        theirs = [_paper(paper.get(m, {}).get(_paper_row(method, methods))) for m in MODELS]
        lines.append(f"| {_label(method, methods)} | {_seeds(results, kind, method)} | "
                     + " | ".join(ours + theirs) + " |")
    return lines


def ood_table(results: list[dict]) -> list[str]:
    """AUROC (%) MP / UM per shifted stream, mean over seeds, SciQ test as the positive class."""
    streams = []
    for r in (r for r in results if r["kind"] == "ood"):
        for key in r["metrics"]:
            if key.startswith("ood/") and key.endswith("/auroc_mp") and key.split("/")[1] not in streams:
                streams.append(key.split("/")[1])
    scores = [k for k in ("mp", "um", "energy", "maha")
              if any(f"ood/{s}/auroc_{k}" in r["metrics"] for r in results if r["kind"] == "ood" for s in streams)]
    names = {"mp": "MP", "um": "UM", "energy": "EN", "maha": "MD"}
    head = ["Method", "seeds", *(f"{dataset_name(s)} {' / '.join(names[k] for k in scores)}" for s in streams)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    methods = _methods(results, "ood")
    for method in methods:
        cells = []
        for s in streams:
            cells.append(
                " / ".join(_ours(_values(results, "ood", method, f"ood/{s}/auroc_{k}")[1], 100, 1) for k in scores)
            )
        lines.append(f"| {_label(method, methods)} | {_seeds(results, 'ood', method)} | " + " | ".join(cells) + " |")
    return lines


def matched_shift(results: list[dict]) -> float:
    """The largest change of any mean AUROC (points) when both sides keep only the matched option count."""
    keys = {k for r in results if r["kind"] == "ood" for k in r["metrics"]
            if k.startswith("ood/") and "/auroc_" in k and not k.endswith("_matched")}
    worst = 0.0
    for method in _methods(results, "ood"):
        for key in keys:
            full, matched = (_values(results, "ood", method, k)[1] for k in (key, key + "_matched"))
            if full and matched:
                worst = max(worst, abs(np.mean(full) - np.mean(matched)) * 100)
    return worst


def paper_ood_table(paper: dict) -> list[str]:
    """Table 3: OBQA as in-distribution, AUROC (%) MP / UM per target, both models."""
    targets = list(next(iter(next(iter(paper.values())).values())))
    head = ["Method", *(f"{m} OBQA → {t} MP / UM" for m in MODELS for t in targets)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in [m for m in METHODS if any(m in paper.get(model, {}) for model in MODELS)]:  # the paper's methods
        cells = []
        for m in MODELS:
            for t in targets:
                c = paper.get(m, {}).get(method, {}).get(t)
                cells.append("" if c is None else " / ".join("–" if c[k] is None else f"{c[k][0]:.1f}"
                                                              for k in ("mp", "um")))
        lines.append(f"| {METHODS[method].label} | " + " | ".join(cells) + " |")
    return lines


def _ratio(value, ref) -> str:
    return f"{value / ref:.2f}x" if value and ref else "–"


def cost_table(efficiency: dict, paper: dict) -> list[str]:
    """Ours (``benchmarks.method_efficiency``: one run at a time, each pass in its own process) beside the paper's
    Llama3-8B figures, both as ratios to MAP; absolute numbers in brackets for ours."""
    methods = efficiency["methods"]
    ref, paper_ref = methods["map"], paper.get("map", {})
    cols = [("train_samples_per_s", ".2f", "q/s"), ("test_samples_per_s", ".2f", "q/s"),
            ("train_peak_rss_mib", ".0f", "MiB"), ("eval_peak_rss_mib", ".0f", "MiB")]
    head = ["Method", "train samples/s", "test samples/s", "peak train memory", "peak test memory",
            "paper test samples/s", "paper train samples/s", "paper train memory"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in [m for m in METHODS if m in methods]:
        v = methods[method]
        reused = v.get("reuses_training_of")
        cells = []
        for key, fmt, unit in cols:
            if key.startswith("train") and reused:
                cells.append(f"{METHODS[reused].label}'s")
            elif v.get(key) is None:
                cells.append("–")
            else:
                cells.append(f"{_ratio(v[key], ref.get(key))} ({v[key]:{fmt}} {unit})")
        theirs = paper.get(method, {})
        cells += [_ratio((theirs.get(k) or (None,))[0], (paper_ref.get(k) or (None,))[0])
                  for k in ("test_samples_per_s", "train_samples_per_s", "train_memory_gb")]
        lines.append(f"| {METHODS[method].label} | " + " | ".join(cells) + " |")
    fits = [f"{fit['fit_seconds']:.0f} s" for fit in methods.get("laplace", {}).get("posthoc") or []
            if fit.get("fit_seconds") is not None]
    if fits:
        lines += ["", f"Laplace's post-hoc fit (curvature and prior choice) took {', '.join(fits)} on top of MAP's "
                      f"training ({ref['train_seconds']:.0f} s); its test samples/s leave the fit out."]
    return lines


def _ood_streams(results: list[dict], method: str, key: str) -> dict[int, dict[str, float]]:
    """Per seed, the metric ``ood/<stream>/<key>`` (e.g. ``auroc_um``) on each shifted stream of ``method``'s ood runs
    (a ``<method>:no_posthoc`` row reads them without the post-hoc step)."""
    by_seed: dict = {}
    for name, r, m in method_metrics(results, "ood"):
        if name == method:
            streams = {k.split("/")[1]: float(v) for k, v in m.items()
                       if k.startswith("ood/") and k.endswith("/" + key) and v is not None}
            if streams:
                by_seed[r["seed"]] = streams
    return dict(sorted(by_seed.items()))


def _ood_means(results: list[dict], method: str, score: str) -> list[float]:
    """Per seed (in seed order), the mean AUROC by ``score`` over the shifted streams of ``method``'s ood runs."""
    by_seed = _ood_streams(results, method, f"auroc_{score}")
    return [float(np.mean(list(streams.values()))) for streams in by_seed.values()]


def sigma_ablation_table(results: list[dict], ablation: list[dict]) -> list[str]:
    """IB-EDL with its learned sigma (the grid's runs) against sigma frozen at a constant in training
    (``benchmarks/sciq_sigma_ablation.yaml``): in-distribution Acc / ECE / NLL and the mean AUROC over the shifted
    streams by max probability and by 1/u, each with the post-hoc zeta both arms fitted; mean ± std over seeds."""
    head = ["IB-EDL + post-hoc ζ", "seeds", "Acc (%)", "ECE (%)", "NLL", "mean AUROC MP (%)", "mean AUROC UM (%)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in (("learned σ (the grid)", results), ("σ frozen (the ablation)", ablation)):
        cells = [_ours(_values(runs, "id", "ib_edl", key)[1], scale, digits)
                 for key, scale, digits in (("accuracy", 100, 2), ("ece", 100, 2), ("nll", 1, 3))]
        cells += [_ours(_ood_means(runs, "ib_edl", score), 100, 1) for score in ("mp", "um")]
        lines.append(f"| {label} | {_seeds(runs, 'id', 'ib_edl')} | " + " | ".join(cells) + " |")
    return lines


IB0 = "ib_edl" + NO_POSTHOC  # IB-EDL as the paper runs it, without the post-hoc zeta
SIGMA_HEAD_ARMS = ("trained", "frozen")  # benchmarks/sciq_sigma_<arm>.yaml
SIGMA_HEAD_NOTE = ("IB-EDL at ζ = 0 (its 1/u then comes from the evidence head alone), mean ± std over seeds; ρ is "
                   "Spearman's rank correlation of each question's σ (its mean over the options) with 1/u; an AUROC "
                   "takes SciQ test as the positive class and σ (or 1/u) as the score.")


def sigma_head_table(arms: list[tuple[str, list[dict]]]) -> list[str]:
    """IB-EDL's sigma head trained against frozen at its initialisation (``arms``: (label, results) each, e.g.
    ``benchmarks/sciq_sigma_trained.yaml`` and ``sciq_sigma_frozen.yaml``), at zeta 0: sigma's spread, test NLL and
    rank correlation with 1/u in distribution; then per shifted stream sigma's rank correlation with 1/u and its
    AUROC as an OOD score beside 1/u's. Mean ± std over seeds."""
    head = ["σ head", "seeds", "median σ", "CV of σ", "test NLL", "ρ(σ, 1/u), SciQ test"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in arms:
        cells = [_ours(_values(runs, "id", IB0, key)[1], 1, 3)
                 for key in ("sigma/median", "sigma/cv", "nll", "sigma/spearman_inv_u")]
        lines.append(f"| {label} | {_seeds(runs, 'id', IB0)} | " + " | ".join(cells) + " |")
    keys = ("sigma_spearman_inv_u", "auroc_sigma", "auroc_um")
    per_arm = {label: {key: list(_ood_streams(runs, IB0, key).values()) for key in keys} for label, runs in arms}
    streams = list(dict.fromkeys(s for v in per_arm.values() for by_seed in v["auroc_sigma"] for s in by_seed))
    if not streams:
        return lines
    head = (["shifted stream"] + [f"ρ(σ, 1/u), {label}" for label, _ in arms]
            + [f"AUROC σ, {label}" for label, _ in arms] + [f"AUROC 1/u, {label}" for label, _ in arms])
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stream in streams:
        cells = [_ours([by_seed[stream] for by_seed in per_arm[label][key] if stream in by_seed], 1, 3)
                 for key in keys for label, _ in arms]
        lines.append(f"| {dataset_name(stream)} | " + " | ".join(cells) + " |")
    return lines


BETTER = ("lower", "higher", "no_worse")


@dataclass(frozen=True)
class Claim:
    """One of the paper's claims as a paired difference per seed: ``a`` minus ``b`` (each (method row, metric); an
    ``ood`` metric is a score's AUROC averaged over the shifted streams both rows have; ``b`` may name several rows,
    then the best of them on that seed, and a seed counts only where all have it), x ``scale``. It holds on a seed
    where the difference has the sign ``better`` names, or for a ``no_worse`` claim (the paper's "comparable
    accuracy": not worse, more is no failure) where it is above ``-tolerance``. ``paper``: the paper makes the
    claim (its words: reproduced, direction only, not reproduced); else one we add (holds, direction only, does
    not hold)."""

    text: str
    kind: str
    a: tuple[str, str]
    b: tuple[tuple[str, str], ...]
    scale: float
    better: str
    tolerance: float = 0.0
    paper: bool = True

    def __post_init__(self):
        if self.better not in BETTER:
            raise ValueError(f"better must be one of {BETTER}, got {self.better!r}")
        if self.kind not in ("id", "ood", "noise"):
            raise ValueError(f"kind must be id, ood or noise, got {self.kind!r}")
        if self.better == "no_worse" and self.tolerance <= 0:
            raise ValueError(f"a no_worse claim needs a tolerance > 0, got {self.tolerance}")

    @property
    def best(self):
        """The best of several ``b`` values: min for a lower-is-better claim, else max (a no-worse claim has one)."""
        return min if self.better == "lower" else max

    @property
    def words(self) -> tuple[str, str, str]:
        """The words for "the interval holds it", "only the point does", "neither"."""
        if self.paper:
            return "reproduced", "direction only", "not reproduced"
        return "holds", "direction only", "does not hold"

    def on_side(self, x: float) -> bool:
        """Whether a difference (or an interval's end) lies on the claimed side: below 0 (``lower``), above 0
        (``higher``), at or above ``-tolerance`` (``no_worse``). Rounded to 9 digits first: (0.87 - 0.86) x 100 is
        1.0000000000000009."""
        x = round(x, 9)
        if self.better == "no_worse":
            return x >= -self.tolerance
        return x < 0 if self.better == "lower" else x > 0

    def beyond(self, x: float) -> bool:
        """Whether it lies strictly on the other side (``no_worse``: below ``-tolerance``; else off the side and
        not 0)."""
        return not self.on_side(x) and (self.better == "no_worse" or round(x, 9) != 0)

    @property
    def digits(self) -> int:
        """Decimals of its differences: 3 for an unscaled metric (NLL), 2 for points."""
        return 3 if self.scale == 1 else 2


EDL_METHODS = ("edl", "vid", "i_edl", "r_edl")
EDL_FAMILY = tuple((m, "ece") for m in EDL_METHODS)
EDL_ACCURACY = tuple((m, "accuracy") for m in EDL_METHODS)  # the paper's noise claim: the most accurate of them
BAYESIAN = (("mc_dropout", "ece"), ("laplace", "ece"))  # the post-hoc predictives on MAP's own run
CLAIMS = (
    Claim("IB-EDL is as accurate as MAP (Acc, points; holds when at most 1 point below)", "id", (IB0, "accuracy"),
          (("map", "accuracy"),), 100, "no_worse", 1.0),
    Claim("IB-EDL is better calibrated than MAP (ECE, points)", "id", (IB0, "ece"), (("map", "ece"),), 100, "lower"),
    Claim("IB-EDL has a lower NLL than MAP", "id", (IB0, "nll"), (("map", "nll"),), 1, "lower"),
    Claim("IB-EDL is better calibrated than MAP with temperature scaling (ECE, points; not the paper's comparison)",
          "id", (IB0, "ece"), (("map_ts", "ece"),), 100, "lower", paper=False),
    Claim("IB-EDL is better calibrated than the other EDL methods (ECE, points, against the best of EDL, VID, I-EDL "
          "and R-EDL)", "id", (IB0, "ece"), EDL_FAMILY, 100, "lower"),
    Claim("IB-EDL is better calibrated than MAP's run with a Bayesian predictive (ECE, points, against the better of "
          "MC-Dropout and Laplace-LoRA)", "id", (IB0, "ece"), BAYESIAN, 100, "lower"),
    Claim("IB-EDL is better calibrated than a deep ensemble (ECE, points; three MAP runs, their probabilities "
          "averaged)", "id", (IB0, "ece"), (("ensemble", "ece"),), 100, "lower"),
    Claim("IB-EDL's 1/u flags shifted questions better than MAP's max probability (mean AUROC over the streams, "
          "points)", "ood", (IB0, "um"), (("map", "mp"),), 100, "higher"),
    Claim("Under 30% label noise IB-EDL is more accurate than MAP (Acc, points)", "noise", (IB0, "accuracy"),
          (("map", "accuracy"),), 100, "higher"),
    Claim("Under 30% label noise IB-EDL is more accurate than the other EDL methods (Acc, points, against the most "
          "accurate of EDL, VID, I-EDL and R-EDL)", "noise", (IB0, "accuracy"), EDL_ACCURACY, 100, "higher"),
    Claim("Under 30% label noise IB-EDL is better calibrated than the other EDL methods (ECE, points, against the "
          "best of EDL, VID, I-EDL and R-EDL)", "noise", (IB0, "ece"), EDL_FAMILY, 100, "lower"),
    Claim("Under 30% label noise IB-EDL is better calibrated than a deep ensemble (ECE, points; not the paper's "
          "comparison, whose ensemble claim is in distribution)", "noise", (IB0, "ece"), (("ensemble", "ece"),), 100,
          "lower", paper=False),
)


def head_to_head(tag: str) -> tuple[Claim, ...]:
    """An arm's IB-EDL (its rows tagged ``ib_edl@<tag>``) against the grid's own, at zeta 0: "holds" where the arm
    is better (grid_intervals --against)."""
    arm = f"ib_edl@{tag}" + NO_POSTHOC
    return (
        Claim("accuracy, the arm minus the grid's IB-EDL (points)", "id", (arm, "accuracy"), ((IB0, "accuracy"),), 100,
              "higher"),
        Claim("ECE, the arm minus the grid's IB-EDL (points)", "id", (arm, "ece"), ((IB0, "ece"),), 100, "lower"),
        Claim("NLL, the arm minus the grid's IB-EDL", "id", (arm, "nll"), ((IB0, "nll"),), 1, "lower"),
        Claim("1/u's mean AUROC over the streams, the arm minus the grid's IB-EDL (points)", "ood", (arm, "um"),
              ((IB0, "um"),), 100, "higher"),
    )


INTERVALS_HEADER = " (pooled 95% interval; over seeds)"  # a column whose cells carry kept predictions' intervals
INTERVALS_NOTE = ("Each cell of a column headed (pooled 95% interval; over seeds): the difference IB-EDL minus the "
                  "other row (the best of them on each seed where a claim names several) on the same questions, its "
                  "mean over the seeds and the 95% interval of that mean over paired resamples of the test questions "
                  "(benchmarks/grid_intervals.py; it carries the test set's sampling error, not a new seed's spread); "
                  "where two or more seeds have it, the 95% interval over seeds: for the expected difference of a seed"
                  " drawn at random, carrying both the seeds' spread (Student's t, n - 1 degrees of freedom) and the "
                  "test questions' sampling error (the pooled resamples' variance), combined in quadrature, so wide "
                  "rather than narrow; then on how many seeds the seed's own interval lies on the claimed side (for "
                  "the accuracy claim: above -1 point) and on how many the point does, and, where any, on how many it "
                  "lies wholly on the other side. The other columns: mean ± std over seeds, and on how many the point "
                  "goes the claimed way (their predictions were not kept). The word before each cell: reproduced where"
                  " the pooled interval and the one over seeds lie on the claimed side, each seed's own interval does "
                  "on more than half of the seeds and on none lies against it; direction only where the pooled point "
                  "does (and, without kept predictions, at most that); else not reproduced, (against) where the pooled"
                  " interval lies wholly on the other side. For a comparison the paper does not make: holds, direction"
                  " only, does not hold.")
CLAIMS_NOTE = ("Each cell: the difference IB-EDL minus the other row (the best of them where a claim names several), "
               "mean ± std over the seeds that have them all, and on how many of those seeds it goes the claimed "
               "way, after a word: direction only where the mean goes the claimed way (without kept predictions no "
               "interval can say more), else not reproduced (does not hold, for a comparison the paper does not make); "
               "the paper's column is the same difference in its own "
               "numbers. IB-EDL with its post-hoc ζ and every other method are in the tables of each protocol.")


def _per_seed(results: list[dict], kind: str, row: tuple[str, str]) -> dict[int, float | dict[str, float]]:
    """Per seed, the row's metric; for ``ood``, the score's AUROC per stream."""
    method, metric = row
    if kind == "ood":
        return _ood_streams(results, method, f"auroc_{metric}")
    seeds, values = _values(results, kind, method, metric)
    return dict(zip(seeds, values, strict=True))


def claim_diffs(claim: Claim, results: list[dict]) -> list[float]:
    """The claim's difference (x scale) on each seed that has ``a`` and every ``b`` row, in seed order."""
    a = _per_seed(results, claim.kind, claim.a)
    bs = [_per_seed(results, claim.kind, row) for row in claim.b]
    diffs = []
    for seed in sorted(set(a).intersection(*bs)):
        if claim.kind == "ood":  # the mean over the streams every row has
            streams = set(a[seed]).intersection(*(b[seed] for b in bs))
            if not streams:
                continue
            means = [float(np.mean([d[seed][s] for s in sorted(streams)])) for d in (a, *bs)]
            diffs.append((means[0] - claim.best(means[1:])) * claim.scale)
        else:
            diffs.append((a[seed] - claim.best(b[seed] for b in bs)) * claim.scale)
    return diffs


def claim_cell(claim: Claim, results: list[dict]) -> str:
    """``mean ± std (k of n seeds)`` of the claim's paired difference, k the seeds on which it holds; ``–`` where
    no seed has every row."""
    diffs = claim_diffs(claim, results)
    if not diffs:
        return "–"
    held = sum(claim.on_side(d) for d in diffs)
    spread = f" ± {np.std(diffs):.{claim.digits}f}" if len(diffs) > 1 else ""
    mean = float(np.mean(diffs))
    word = claim.words[1 if claim.on_side(mean) else 2]  # no interval: at most the direction
    shown = round(mean, claim.digits) or 0.0  # no "-0.00"
    return f"{word}: {shown:+.{claim.digits}f}{spread} ({held} of {len(diffs)} seed{'s' if len(diffs) > 1 else ''})"


def _paper_value(paper: dict, claim: Claim, row: tuple[str, str], model: str) -> float | None:
    """A claim's row in the paper's numbers for ``model`` (in the paper's units: points, NLL as is), or None."""
    method, metric = row
    cells = paper[claim.kind].get(model, {}).get(_bare(method))
    if not cells:
        return None
    if claim.kind == "ood":  # Table 3: the mean over its targets
        values = [target[metric][0] for target in cells.values() if target.get(metric)]
        return float(np.mean(values)) if values else None
    return cells[metric][0] if cells.get(metric) else None


def paper_claim_cell(claim: Claim, paper: dict) -> str:
    """The same difference in the paper's SciQ numbers (Tables 1-2, the appendix's noise tables) or its Table 3
    (OOD: OBQA as in-distribution, mean over its targets), per model; empty where the paper lacks a row."""
    cells = []
    for model in MODELS:
        a = _paper_value(paper, claim, claim.a, model)
        bs = [_paper_value(paper, claim, row, model) for row in claim.b]
        if a is not None and all(b is not None for b in bs):
            cells.append(f"{model} {a - claim.best(bs):+.{claim.digits}f}")
    return ", ".join(cells)


def interval_verdict(claim: Claim, entry: dict) -> str:
    """A claim's word in one regime from its intervals (benchmarks.grid_intervals): ``reproduced`` where the pooled
    interval and the interval over seeds (so two seeds at least) lie on the claimed side, each seed's own interval
    does on more than half of the seeds and on none lies against it; ``direction only`` where the pooled point is on
    the claimed side; else ``not reproduced``, with ``(against)`` where the pooled interval lies wholly on the other
    side (:attr:`Claim.words` for a claim the paper does not make)."""
    pooled, n = entry["pooled"], entry["seeds"]
    if "verdict" not in pooled:
        raise ValueError(f"the intervals of {claim.text!r} lack a pooled verdict: run benchmarks.grid_intervals again")
    holds, direction, neither = claim.words
    if n >= 2 and "over_seeds" not in entry:
        raise ValueError(f"the intervals of {claim.text!r} lack the interval over seeds: run benchmarks.grid_intervals "
                         "again")
    over_seeds = entry.get("over_seeds", {}).get("verdict")
    if pooled["verdict"] == over_seeds == "holds" and 2 * entry["held_on"] > n and not entry.get("against_on"):
        return holds
    if pooled["verdict"] in ("holds", "direction"):
        return direction
    return f"{neither} (against)" if pooled.get("against") else neither


def interval_cell(claim: Claim, entry: dict | None) -> str:
    """A claim's paired interval on a grid's kept predictions (benchmarks.grid_intervals): the difference pooled over
    the seeds, its 95% interval, its interval over seeds and questions (where two or more seeds; ``over_seeds``), on
    how many seeds the per-seed interval holds it and the point goes its way, and (where any) on how many the
    interval lies wholly against it."""
    if not entry or not entry.get("seeds"):
        return "–"
    pooled, n = entry["pooled"], entry["seeds"]
    low, high = pooled["ci95"]
    d = claim.digits
    against = f", against it on {entry['against_on']} of {n}" if entry.get("against_on") else ""
    seeds = entry.get("over_seeds")
    spread = f"; over seeds [{seeds['ci95'][0]:+.{d}f}, {seeds['ci95'][1]:+.{d}f}]" if seeds else ""
    return (f"{interval_verdict(claim, entry)}: {pooled['difference']:+.{d}f} [{low:+.{d}f}, {high:+.{d}f}]{spread}; "
            f"interval holds on {entry['held_on']} of "
            f"{n}, direction on {entry['direction_on']} of {n}{against} seed{'s' if n > 1 else ''}")


def claims_table(columns: list[tuple[str, list[dict], dict | None]], paper: dict) -> list[str]:
    """The paper's claims about IB-EDL, one column per grid (header, results, and its intervals by claim text or
    None): a paired interval where the grid's predictions were kept, else the difference per seed (mean ± std),
    beside the same difference in the paper's numbers."""
    head = ["Claim (IB-EDL at ζ = 0, as the paper runs it)", "in the paper (SciQ; OOD: its Table 3)",
            *(header for header, _, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for claim in CLAIMS:
        cells = [interval_cell(claim, intervals.get(claim.text)) if intervals is not None
                 else claim_cell(claim, results) for _, results, intervals in columns]
        lines.append(f"| {claim.text} | {paper_claim_cell(claim, paper)} | " + " | ".join(cells) + " |")
    return lines


def _trajectory_line(record: dict) -> str:
    """MAP's validation NLL over a run: start, the lowest pass (its step), the end."""
    training = record.get("training") or {}
    start, end = (training.get("validation_start") or {}), (training.get("validation_end") or {})
    passes = training.get("trajectory") or []
    if not passes or "nll" not in start:
        return "–"
    low = min(passes, key=lambda p: p["nll"])
    return f"{start['nll']:.3f} → {low['nll']:.3f} (step {low['step']}) → {end['nll']:.3f}"


def regime_table(runs: list[tuple[str, list[dict], dict | None]], earlier: dict[str, list[dict]]) -> list[str]:
    """Is MAP over-confident under a fixed budget? One row per MAP cell of each of ``runs`` (label, results, intervals
    or None: the grid's own and its regime checks'): its validation NLL over training, and on the test questions its
    accuracy, mean confidence, their gap and ECE with 95% intervals (the intervals' ``map_over_confidence``), then
    MAP's test ECE in the ``earlier`` grids."""
    head = ["run", "seed", "validation NLL: start → lowest (step) → end", "test accuracy", "mean confidence",
            "confidence − accuracy (points) [95%]", "ECE % [95%]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, results, intervals in runs:
        over = (intervals or {}).get("map_over_confidence") or {}
        for name, r, m in method_metrics(results, "id"):
            if name != "map":
                continue
            seed = over.get(str(r["seed"]))
            if seed:
                gap, ece = seed["over_confidence"], seed["ece"]
                cells = [f"{100 * gap['value']:+.1f} [{100 * gap['ci95'][0]:+.1f}, {100 * gap['ci95'][1]:+.1f}]",
                         f"{100 * ece['value']:.1f} [{100 * ece['ci95'][0]:.1f}, {100 * ece['ci95'][1]:.1f}]"]
            else:
                cells = ["–", f"{100 * m['ece']:.1f}"]
            confidence = seed["mean_confidence"] if seed else m.get("mean_confidence")
            lines.append(f"| {label} | {r['seed']} | {_trajectory_line(r)} | {100 * m['accuracy']:.1f}% | "
                         + ("–" if confidence is None else f"{confidence:.3f}") + " | " + " | ".join(cells) + " |")
    others = []
    for grid, runs in earlier.items():
        seeds, values = _values(runs, "id", "map", "ece")
        if values:
            size = _test_size(runs)
            others.append(f"{GRID_COLUMNS[grid]} {_ours(values, 100, 1)}% ({len(values)} seeds"
                          + (f", {size} test questions)" if size else ")"))
    if others:
        lines += ["", "MAP's test ECE in the other grids (mean ± std over seeds): " + "; ".join(others) + "."]
    return lines


def _test_size(results: list[dict]) -> int:
    return next((int(m["n"]) for name, _, m in method_metrics(results, "id") if name == "map" and "n" in m), 0)


def sections(results: list[dict], paper: dict, efficiency: dict | None = None,
             ablation: list[dict] | None = None, heads: list[tuple[str, list[dict] | None]] | None = None
             ) -> dict[str, str]:
    """The generated blocks of the docs page, by marker name (``cost`` only with the efficiency results, the sigma
    ablation only with its results, ``sigma-head`` only with ``heads``: (label, results or None where the arm has
    none yet) of the sigma head trained and frozen)."""
    shift = matched_shift(results)
    sigma = sigma_table(results) + (sigma_ablation_table(results, ablation) if ablation else [])
    if heads:
        done = [(label, runs) for label, runs in heads if runs]
        missing = [label for label, runs in heads if not runs]  # a label is its arm's name: sciq_sigma_<arm>.yaml
        head_lines = (sigma_head_table(done) + ["", SIGMA_HEAD_NOTE]) if done else []
        head_lines += [f"\nNo results yet for the {label} arm (its config: benchmarks/sciq_sigma_{label}.yaml)."
                       for label in missing]
    return {
        "training": "\n".join(training_table(results)).strip(),
        "sigma": "\n".join(sigma).strip(),
        "id": "\n".join(calibration_table(results, "id", paper["id"], selective=True)),
        "ood": "\n".join(ood_table(results) + [
            "", f"With the option count matched (both sides restricted to the same number of options) no mean AUROC "
                f"above moves by more than {shift:.1f} points; the report has both tables."]),
        "paper-ood": "\n".join(paper_ood_table(paper["ood"])),
        "noise": "\n".join(calibration_table(results, "noise", paper["noise"], selective=False)),
        **({"cost": "\n".join(cost_table(efficiency, paper["cost"]))} if efficiency else {}),
        **({"sigma-head": "\n".join(head_lines).strip()} if heads else {}),
    }


def start_overlap_line(results: list[dict]) -> str:
    """One sentence: how many of the runs' training questions their start (``init_from``) had drawn for its own
    training, from each record's ``training.start_overlap``."""
    found = [(r["training"] or {}).get("start_overlap") for r in results if r.get("training") is not None]
    overlaps = [o for o in found if o]
    if not overlaps:
        return "The runs did not record how many of their training questions their start had seen."
    seen = sorted({o["seen_by_start"] for o in overlaps})
    sizes = sorted({o["questions"] for o in overlaps})
    starts = sorted({o["start"] for o in overlaps})
    return (f"Training questions the start ({', '.join(starts)}) had drawn for its own training: "
            f"{' or '.join(map(str, seen))} of {' or '.join(map(str, sizes))} in each of the {len(overlaps)} cells "
            f"that recorded it (training.start_overlap).")


def result_files(name: str) -> tuple[str, str]:
    """Where a grid's (or an arm's) results and its paired intervals are committed."""
    return f"benchmarks/results/{name}.json", f"benchmarks/results/{name}_intervals.json"


def grid_sections(results: list[dict] | None, paper: dict, grid: str, earlier: dict[str, list[dict]],
                  intervals: dict | None = None,
                  checks: dict[str, tuple[list[dict], dict | None]] | None = None,
                  arms: dict[str, dict | None] | None = None,
                  read: dict[str, tuple[str, str | None]] | None = None) -> dict[str, str]:
    """The blocks of a grid other than the first (``GRID_BLOCKS``, named with its ``GRIDS`` prefix): the first
    grid's training, calibration and OOD tables on its results, the training block with the start's overlap, and
    ``claims``: the paper's claims under each earlier grid (``earlier``: grid -> results) and this one, by paired
    interval where ``intervals`` (benchmarks.grid_intervals' output) is given; a grid in ``KEPT_PREDICTIONS`` also
    has ``regime`` (:func:`regime_table`: its MAP cells and its regime ``checks``', label -> (results, intervals)).
    ``arms``: label -> intervals (None: not run yet) of the arms beside the grid (``ARMS``), a claims column each.
    ``claims`` ends with its columns' sources: ``read`` (grid or arm name -> the results and intervals files the
    caller read; default :func:`result_files`'). With no results (None or an empty list) each block but ``claims``
    and ``regime`` says so."""
    prefix = GRIDS[grid]
    by_claim = None if intervals is None else intervals.get("claims", {})
    columns = [(GRID_COLUMNS[g], runs, None) for g, runs in earlier.items()]
    columns.append((GRID_COLUMNS[grid] + (INTERVALS_HEADER if by_claim is not None else ""), results or [],
                    by_claim))
    columns += [(label + INTERVALS_HEADER, [], found.get("claims", {}))
                for label, found in (arms or {}).items() if found is not None]
    note = INTERVALS_NOTE if by_claim is not None else CLAIMS_NOTE
    waiting = [f"No intervals yet for the arm \"{label}\" (benchmarks/{name}.yaml): run it, then python -m "
               f"benchmarks.grid_intervals --grid {name} --against {grid}."
               for name, label in ARMS.get(grid, {}).items() if (arms or {}).get(label, "absent") is None]
    read = read or {}

    def shown(path: str) -> str:  # relative to the repository (the working directory) where it lies inside it
        resolved, here = Path(path).resolve(), Path.cwd().resolve()
        return str(resolved.relative_to(here)) if resolved.is_relative_to(here) else str(path)

    def source(name: str, label: str, with_intervals: bool) -> str:
        files = read.get(name, result_files(name))
        return (f"{label}: `{shown(files[0])}`"
                + (f", intervals `{shown(files[1])}`" if with_intervals and files[1] else ""))

    sources = [source(g, GRID_COLUMNS[g], False) for g in earlier]
    sources.append(source(grid, GRID_COLUMNS[grid], by_claim is not None))
    sources += [source(name, label, True) for name, label in ARMS.get(grid, {}).items()
                if (arms or {}).get(label) is not None]
    claims = "\n".join(claims_table(columns, paper) + ["", note, "", "Sources: " + "; ".join(sources) + "."]
                       + (["", *waiting] if waiting else []))
    extra = {prefix + "claims": claims}
    if grid in KEPT_PREDICTIONS:
        checks = [(label, found[0], found[1]) for label, found in (checks or {}).items()]
        extra[prefix + "regime"] = "\n".join(regime_table([(REGIME_LABELS[grid], results or [], intervals), *checks],
                                                          earlier) + (
            [] if intervals is not None else
            ["", f"No intervals yet: python -m benchmarks.grid_predictions --grid {grid}, then python -m "
                 f"benchmarks.grid_intervals --grid {grid}."]))
    if not results:
        empty = (f"No results yet: the grid (benchmarks/{grid}.yaml) has no finished cell. Run it, then "
                 f"python -m benchmarks.paper_comparison --grid {grid}.")
        return {**{prefix + name: empty for name in GRID_BLOCKS}, **extra}
    blocks = sections(results, paper)
    blocks["training"] = blocks["training"] + "\n\n" + start_overlap_line(results)
    return {**{prefix + name: blocks[name] for name in GRID_BLOCKS}, **extra}


def fill(page: str, blocks: dict[str, str]) -> str:
    """``page`` with each ``<!-- begin generated: paper-comparison NAME -->`` block replaced by ``blocks[NAME]``.

    Raises:
        ValueError: a block has no markers in the page.
    """
    for name, body in blocks.items():
        begin = f"<!-- begin generated: paper-comparison {name} -->"
        end = f"<!-- end generated: paper-comparison {name} -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), flags=re.S)
        if not pattern.search(page):
            raise ValueError(f"the docs page has no '{begin}' ... '{end}' markers")
        replacement = f"{begin}\n{body}\n{end}"
        page = pattern.sub(lambda _, text=replacement: text, page)
    return page


def _read_if_there(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paper_comparison", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=list(GRIDS), default="sciq_grid",
                        help="which grid's blocks to fill: sciq_grid (early stopping, with the cost table and the "
                             "sigma ablation), sciq_grid_paper (a fixed budget, per-family learning rates) or "
                             "sciq_grid_shared_lr (a fixed budget, one learning rate) (default sciq_grid)")
    parser.add_argument("--results", help="the grid's results file (default benchmarks/results/<grid>.json)")
    parser.add_argument("--first-results", default="benchmarks/results/sciq_grid.json",
                        help="the first grid's results, beside a second grid's in its claims block")
    parser.add_argument("--intervals",
                        help="a grid's paired intervals (python -m benchmarks.grid_intervals; default "
                             "benchmarks/results/<grid>_intervals.json, used where it exists)")
    parser.add_argument("--efficiency", default="benchmarks/results/method_efficiency.json",
                        help="python -m benchmarks.method_efficiency's results (the cost table)")
    parser.add_argument("--ablation", default="benchmarks/results/sciq_sigma_ablation.json",
                        help="the sigma ablation's results (benchmarks/sciq_sigma_ablation.yaml); left out if absent")
    parser.add_argument("--sigma-heads", nargs=2, metavar=("TRAINED", "FROZEN"),
                        default=[f"benchmarks/results/sciq_sigma_{arm}.json" for arm in SIGMA_HEAD_ARMS],
                        help="the sigma-head ablation's two arms' results (benchmarks/sciq_sigma_trained.yaml and "
                             "sciq_sigma_frozen.yaml); an arm not run yet is named in its block")
    parser.add_argument("--paper", help=f"the paper's LaTeX source (default ${PAPER_ENV} or ../shared/paper/...)")
    parser.add_argument("--docs", default="docs/results.md", help="the page whose generated blocks are (re)written")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    paper_path = Path(args.paper) if args.paper else default_paper()
    results_path = args.results or result_files(args.grid)[0]
    first = args.grid == next(iter(GRIDS))
    try:
        # the first grid's results must exist; a grid still running may have no results file yet
        results = json.loads(Path(results_path).read_text()) if first or Path(results_path).is_file() else []
        paper = parse_paper(paper_path.read_text())
        docs = Path(args.docs)
        page = docs.read_text()
        if first:
            efficiency = json.loads(Path(args.efficiency).read_text())
            ablation = json.loads(Path(args.ablation).read_text()) if Path(args.ablation).is_file() else None
            heads = [(arm, json.loads(Path(path).read_text()) if Path(path).is_file() else None)
                     for arm, path in zip(SIGMA_HEAD_ARMS, args.sigma_heads, strict=True)]
            blocks = sections(results, paper, efficiency, ablation, heads)
        else:
            names = list(GRIDS)
            read = {g: (args.first_results if g == names[0] else result_files(g)[0], None)
                    for g in names[: names.index(args.grid)]}
            earlier = {g: json.loads(Path(files[0]).read_text()) for g, files in read.items()}
            intervals_path = args.intervals or result_files(args.grid)[1]
            intervals = _read_if_there(Path(intervals_path))
            read[args.grid] = (results_path, intervals_path)
            checks = {label: (json.loads(Path(result_files(name)[0]).read_text()),
                              _read_if_there(Path(result_files(name)[1])))
                      for name, label in REGIME_CHECKS.get(args.grid, {}).items()
                      if Path(result_files(name)[0]).is_file()}
            arms = {label: _read_if_there(Path(result_files(name)[1]))
                    for name, label in ARMS.get(args.grid, {}).items()}
            blocks = grid_sections(results, paper, args.grid, earlier, intervals, checks, arms, read)
        updated = fill(page, blocks)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python -m benchmarks.paper_comparison" + ("" if first else f" --grid {args.grid}")
    state = "" if results else " (no results yet)"
    sources = results_path if first else f"{results_path} and {args.first_results}"
    if args.check:
        if updated != page:
            print(f"{docs} is out of date with {sources}{state}: run {command}", file=sys.stderr)
            return 1
        print(f"{docs} matches {sources}{state}")
        return 0
    docs.write_text(updated)
    print(f"wrote the generated tables of {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
