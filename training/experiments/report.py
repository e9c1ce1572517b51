"""Benchmark report in the paper's layout: Markdown tables (mean +- std over seeds, best in bold) for
in-distribution calibration, OOD detection, label noise, ECE bin sensitivity and efficiency, plus
reliability diagrams and risk-coverage plots as PNG."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from training.methods import METHODS

DATASET_NAMES = {"arc_easy": "ARC-E", "arc_challenge": "ARC-C", "obqa": "OBQA", "sciq": "SciQ", "race": "RACE",
                 "csqa": "CSQA", "mmlu": "MMLU"}
# metric key, label, higher is better, scale (x100 for percentages as in the paper)
ID_METRICS = [("accuracy", "Acc (%) ↑", True, 100), ("ece", "ECE (%) ↓", False, 100), ("nll", "NLL ↓", False, 1),
              ("brier", "Brier ↓", False, 1), ("aurc", "AURC ↓", False, 1), ("acc@80", "Acc@80% cov (%) ↑", True, 100),
              ("acc@90", "Acc@90% cov (%) ↑", True, 100)]


def _label(method: str) -> str:
    return METHODS[method].label if method in METHODS else method


def _cell(values: list[float], scale: float) -> tuple[float, str]:
    arr = np.asarray(values, dtype=float) * scale
    mean = float(arr.mean())
    if len(arr) > 1:
        return mean, f"{mean:.2f} ± {arr.std(ddof=0):.2f}"
    return mean, f"{mean:.2f}"


def _table(rows: dict, columns: list[str], higher: bool, scale: float, header: list[str]) -> list[str]:
    """rows[method][column] = list of values -> Markdown with the best mean per column in bold."""
    methods = [m for m in METHODS if m in rows]
    cells = {m: {c: _cell(rows[m][c], scale) if rows[m].get(c) else (None, "–") for c in columns} for m in methods}
    best = {}
    for c in columns:
        means = [cells[m][c][0] for m in methods if cells[m][c][0] is not None]
        best[c] = (max(means) if higher else min(means)) if means else None
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m in methods:
        parts = []
        for c in columns:
            mean, text = cells[m][c]
            parts.append(f"**{text}**" if mean is not None and np.isclose(mean, best[c]) else text)
        lines.append(f"| {_label(m)} | " + " | ".join(parts) + " |")
    return lines


def _group(results: list[dict], kind: str) -> dict:
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in results:
        if r["kind"] == kind:
            for key, value in r["metrics"].items():
                if isinstance(value, (int, float)) and value is not None and np.isfinite(value):
                    grouped[r["method"]][r["dataset"]][key].append(value)
    return grouped


def id_tables(results: list[dict], kind: str = "id", metric_list=ID_METRICS) -> list[str]:
    grouped = _group(results, kind)
    datasets = sorted({r["dataset"] for r in results if r["kind"] == kind}, key=lambda d: list(DATASET_NAMES).index(d) if d in DATASET_NAMES else 99)
    lines = []
    for key, label, higher, scale in metric_list:
        rows = {m: {d: grouped[m][d].get(key, []) for d in datasets} for m in grouped}
        lines += [f"**{label}**", ""] + _table(rows, datasets, higher, scale, ["Method"] + [DATASET_NAMES.get(d, d) for d in datasets]) + [""]
    return lines


def ood_tables(results: list[dict]) -> list[str]:
    runs = [r for r in results if r["kind"] == "ood"]
    if not runs:
        return []
    rows: dict = defaultdict(lambda: defaultdict(list))
    columns, header = [], ["Method"]
    for r in runs:
        for key, value in r["metrics"].items():
            if key.startswith("ood/") and key.endswith(("auroc_mp", "auroc_um")):
                rows[r["method"]][key].append(value)
                if key not in columns:
                    columns.append(key)
    columns.sort()
    for c in columns:
        _, target, score = c.split("/")
        header.append(f"{DATASET_NAMES.get(runs[0]['dataset'], runs[0]['dataset'])} → {DATASET_NAMES.get(target, target)} "
                      f"{'MP' if score.endswith('mp') else 'UM'}")
    return ["AUROC (%) ↑, in-distribution as the positive class; MP = max probability, UM = 1/u "
            "(methods without a Dirichlet have no UM).", ""] + _table(rows, columns, True, 100, header) + [""]


def ece_bins_table(results: list[dict]) -> list[str]:
    grouped = _group(results, "id")
    rows = {m: {f"ece_{b}": [v for d in grouped[m] for v in grouped[m][d].get(f"ece_{b}", [])] for b in (10, 15, 25, 35)}
            for m in grouped}
    return ["ECE (%) ↓ with 10/15/25/35 bins, averaged over in-distribution datasets and seeds.", ""] + _table(
        rows, [f"ece_{b}" for b in (10, 15, 25, 35)], False, 100, ["Method", "10 bins", "15 bins", "25 bins", "35 bins"]) + [""]


def efficiency_table(results: list[dict]) -> list[str]:
    rows: dict = defaultdict(lambda: defaultdict(list))
    for r in results:
        for key in ("train_samples_per_s", "test_samples_per_s", "train_peak_rss_mib"):
            value = r.get("efficiency", {}).get(key)
            if value:
                rows[r["method"]][key].append(value)
    methods = [m for m in METHODS if m in rows]
    lines = ["| Method | Train samples/s | Test samples/s | Peak train memory (MiB RSS) |", "|---|---|---|---|"]
    for m in methods:
        cells = [f"{np.mean(rows[m][k]):.2f}" if rows[m][k] else "–" for k in ("train_samples_per_s", "test_samples_per_s")]
        mem = f"{np.max(rows[m]['train_peak_rss_mib']):.0f}" if rows[m]["train_peak_rss_mib"] else "–"
        lines.append(f"| {_label(m)} | {cells[0]} | {cells[1]} | {mem} |")
    return ["MC-Dropout and Laplace reuse the MAP training run (their train columns repeat MAP's); "
            "Ens trains three adapters.", ""] + lines + [""]


def plots(results: list[dict], runs_root: Path, out_dir: Path) -> list[Path]:
    """Per in-distribution dataset (seed of the first run): risk-coverage of every method, and a
    reliability diagram per method."""
    from training.plots import reliability_diagram, risk_coverage_plot

    paths = []
    by_dataset: dict = defaultdict(dict)
    for r in results:
        if r["kind"] != "id" or r["method"] in by_dataset[r["dataset"]]:
            continue
        trained = METHODS[r["method"]].trained_as
        pred_path = runs_root / f"{r['dataset']}-{trained}-s{r['seed']}" / f"predictions-id-{r['method']}.json"
        if pred_path.is_file():
            sets = json.loads(pred_path.read_text())["sets"]
            by_dataset[r["dataset"]][r["method"]] = sets[r["dataset"]]
    for dataset, methods in by_dataset.items():
        curves = {}
        for method in [m for m in METHODS if m in methods]:
            s = methods[method]
            conf = [max(p) for p in s["probs"]]
            hits = [float(int(np.argmax(p)) == y) for p, y in zip(s["probs"], s["labels"])]
            curves[_label(method)] = (conf, hits)
            paths.append(reliability_diagram(s["probs"], s["labels"], out_dir / f"reliability-{dataset}-{method}.png",
                                             title=f"{_label(method)} on {DATASET_NAMES.get(dataset, dataset)}"))
        if curves:
            paths.append(risk_coverage_plot(curves, out_dir / f"risk-coverage-{dataset}.png",
                                            title=f"Selective prediction on {DATASET_NAMES.get(dataset, dataset)} (score: max prob)"))
    return paths


def write_report(results: list[dict], config: dict, path: Path, runs_root: Path | None = None) -> list[Path]:
    """Write the Markdown report (and PNGs beside it when the runs' predictions exist)."""
    path = Path(path)
    seeds = sorted({r["seed"] for r in results})
    lines = [f"# Benchmark: {config.get('name', path.stem)}", "",
             f"Base model `{config.get('train', {}).get('base_model', '?')}`; seeds {seeds}; "
             f"mean ± std over seeds; best mean in bold. Command: `python -m training.experiments.benchmark --config "
             f"{config.get('config_path', 'benchmarks/' + config.get('name', path.stem) + '.yaml')}`.", ""]
    if any(r["kind"] == "id" for r in results):
        lines += ["## In-distribution calibration", ""] + id_tables(results) + ["## ECE bin sensitivity", ""] + ece_bins_table(results)
    if any(r["kind"] == "ood" for r in results):
        lines += ["## Out-of-distribution detection", ""] + ood_tables(results)
    if any(r["kind"] == "noise" for r in results):
        fraction = next(r["label_noise"] for r in results if r["kind"] == "noise")
        lines += [f"## Label noise ({fraction:.0%} of training labels moved; clean test data)", ""]
        lines += id_tables(results, "noise", ID_METRICS[:3])
    lines += ["## Efficiency", ""] + efficiency_table(results)
    written = [path]
    if runs_root is not None:
        images = plots(results, Path(runs_root), path.parent / f"{path.stem}-plots")
        if images:
            lines += ["## Plots", ""] + [f"![{p.stem}]({p.parent.name}/{p.name})" for p in images] + [""]
            written += images
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return written
