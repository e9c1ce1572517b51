"""Benchmark report in the paper's layout: Markdown tables (mean +- std over seeds, best in bold) for
in-distribution calibration, OOD detection, label noise, ECE bin sensitivity and efficiency, plus
reliability diagrams and risk-coverage plots as PNG."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from ibedl.training.methods import METHODS

DATASET_NAMES = {"arc_easy": "ARC-E", "arc_challenge": "ARC-C", "obqa": "OBQA", "sciq": "SciQ", "race": "RACE",
                 "csqa": "CSQA", "mmlu": "MMLU"}
# metric key, label, higher is better, scale (x100 for percentages as in the paper)
ID_METRICS = [("accuracy", "Acc (%) ↑", True, 100), ("ece", "ECE (%) ↓", False, 100), ("nll", "NLL ↓", False, 1),
              ("brier", "Brier ↓", False, 1), ("aurc", "AURC ↓", False, 1), ("acc@80", "Acc@80% cov (%) ↑", True, 100),
              ("acc@90", "Acc@90% cov (%) ↑", True, 100)]


def dataset_name(spec: str) -> str:
    """Display name of a dataset or a variant (``sciq:no_context`` -> ``SciQ (no passage)``)."""
    name, _, variant = spec.partition(":")
    return DATASET_NAMES.get(name, name) + (
        " (no passage)" if variant == "no_context" else f" ({variant})" if variant else ""
    )


# a cell record's efficiency columns: throughputs (questions/s) and peak memories (MiB RSS of the child process)
EFFICIENCY_KEYS = ("train_samples_per_s", "test_samples_per_s", "train_peak_rss_mib", "eval_peak_rss_mib")
NO_POSTHOC = ":no_posthoc"  # a method's row with its post-hoc step undone (IB-EDL with zeta = 0)


def method_label(method: str) -> str:
    """Display label of a method or its no-post-hoc row (``ib_edl:no_posthoc`` -> ``IB-EDL, ζ = 0``)."""
    if method.endswith(NO_POSTHOC):
        return f"{method_label(method[: -len(NO_POSTHOC)])}, ζ = 0"
    return METHODS[method].label if method in METHODS else method


def method_order(methods) -> list[str]:
    """Registry order, each method's no-post-hoc row right after it."""
    return [m for base in METHODS for m in (base, base + NO_POSTHOC) if m in methods]


def method_metrics(results: list[dict], kind: str):
    """(method, record, metrics) of a kind's results, plus a ``<method>:no_posthoc`` entry where one was measured."""
    for r in results:
        if r["kind"] == kind:
            yield r["method"], r, r["metrics"]
            if r.get("metrics_without_posthoc"):
                yield r["method"] + NO_POSTHOC, r, r["metrics_without_posthoc"]


def mean_std(values: list[float], scale: float, digits: int = 2) -> tuple[float, str]:
    """Mean of ``values`` x ``scale`` and its text, ``mean ± population std`` over more than one value."""
    arr = np.asarray(values, dtype=float) * scale
    mean = float(arr.mean())
    if len(arr) > 1:
        return mean, f"{mean:.{digits}f} ± {arr.std(ddof=0):.{digits}f}"
    return mean, f"{mean:.{digits}f}"


def _table(rows: dict, columns: list[str], higher: bool, scale: float, header: list[str]) -> list[str]:
    """rows[method][column] = list of values -> Markdown with the best mean per column in bold."""
    methods = method_order(rows)
    cells = {m: {c: mean_std(rows[m][c], scale) if rows[m].get(c) else (None, "–") for c in columns} for m in methods}
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
        lines.append(f"| {method_label(m)} | " + " | ".join(parts) + " |")
    return lines


def _group(results: list[dict], kind: str) -> dict:
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for method, r, values in method_metrics(results, kind):
        for key, value in values.items():
            if isinstance(value, (int, float)) and value is not None and np.isfinite(value):
                grouped[method][r["dataset"]][key].append(value)
    return grouped


def id_tables(results: list[dict], kind: str = "id", metric_list=ID_METRICS) -> list[str]:
    grouped = _group(results, kind)
    datasets = sorted(
        {r["dataset"] for r in results if r["kind"] == kind},
        key=lambda d: list(DATASET_NAMES).index(d) if d in DATASET_NAMES else 99,
    )
    lines = []
    for key, label, higher, scale in metric_list:
        rows = {m: {d: grouped[m][d].get(key, []) for d in datasets} for m in grouped}
        lines += (
            [f"**{label}**", ""]
            + _table(rows, datasets, higher, scale, ["Method"] + [dataset_name(d) for d in datasets])
            + [""]
        )
    return lines


# OOD scores of a cell's metrics (ibedl.training.experiments.evaluate_run): key suffix -> label
OOD_SCORES = {"mp": "max probability (MP)", "um": "1/u (UM)", "energy": "energy (logsumexp of the option logits)",
              "maha": "Mahalanobis distance of the head's hidden state"}


def ood_tables(results: list[dict]) -> list[str]:
    """One AUROC table per score (columns: the shifted streams and their mean), on all questions, then the streams'
    mean per score with the option count matched."""
    runs = [r for r in results if r["kind"] == "ood"]
    if not runs:
        return []
    source = dataset_name(runs[0]["dataset"])
    streams = sorted({k.split("/")[1] for r in runs for k in r["metrics"] if k.startswith("ood/")})
    lines = []
    for score, label in OOD_SCORES.items():
        rows: dict = defaultdict(lambda: defaultdict(list))
        for method, _r, values in method_metrics(results, "ood"):
            found = [values.get(f"ood/{s}/auroc_{score}") for s in streams]
            for s, v in zip(streams, found, strict=True):
                if v is not None:
                    rows[method][s].append(v)
            if all(v is not None for v in found):
                rows[method]["mean"].append(float(np.mean(found)))
        if not rows:
            continue
        header = ["Method"] + [dataset_name(s) for s in streams] + ["mean"]
        lines += [f"AUROC (%) ↑ by {label}, {source} against each shifted stream (in-distribution is the positive "
                  "class).", ""] + _table(rows, [*streams, "mean"], True, 100, header) + [""]
    matched: dict = defaultdict(lambda: defaultdict(list))
    for method, _r, values in method_metrics(results, "ood"):
        for score in OOD_SCORES:
            found = [values.get(f"ood/{s}/auroc_{score}_matched") for s in streams]
            found = [v for v in found if v is not None]
            if found:
                matched[method][score].append(float(np.mean(found)))
    if matched:
        counts = {r["metrics"].get(f"ood/{s}/matched_options") for r in runs for s in streams} - {None}
        columns = [c for c in OOD_SCORES if any(matched[m].get(c) for m in matched)]
        lines += [f"AUROC (%) ↑ with the option count matched (both sides restricted to "
                  f"{', '.join(str(c) for c in sorted(counts))}-option questions), mean over the streams that have "
                  "enough such questions.", ""]
        lines += _table(
            matched, columns, True, 100, ["Method"] + [c.upper() if len(c) == 2 else c for c in columns]
        ) + [""]
    return lines


def training_table(results: list[dict]) -> list[str]:
    """Validation metrics at the start and the end of each method's training (means over the seeds' runs, before
    any post-hoc step), and the steps run: a reader sees that training moved each method."""
    rows: dict = defaultdict(lambda: defaultdict(list))
    seen = set()
    for r in results:
        t = r.get("training") or {}
        key = (r["method"], r["seed"], r["label_noise"])
        if r["kind"] == "ood" or key in seen or not t.get("validation_start") or not t.get("validation_end"):
            continue
        seen.add(key)
        group = (r["method"], "noise" if r["label_noise"] else "clean")
        for k in ("accuracy", "mean_confidence", "ece", "nll"):
            rows[group][f"{k}_start"].append(t["validation_start"][k])
            rows[group][f"{k}_end"].append(t["validation_end"][k])
        rows[group]["steps"] += [s for s in t["steps"] if s is not None]
        rows[group]["best"] += [s for s in t["best_steps"] if s is not None]
        rows[group]["patience"] += [b == "patience" for b in t["stopped_by"]]
        rows[group]["budget"].append(t["budget_steps"])
    if not rows:
        return []
    lines = [
        "| Method | Labels | Acc (%) start → end | Confidence start → end | ECE (%) start → end | NLL start → end | "
        "Steps run (best) of budget | Stopped by patience |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {m: i for i, m in enumerate(METHODS)}
    for (method, labels), v in sorted(rows.items(), key=lambda kv: (kv[0][1] != "clean", order.get(kv[0][0], 99))):
        def pair(k: str, scale: float, digits: int, v=v) -> str:
            return f"{np.mean(v[k + '_start']) * scale:.{digits}f} → {np.mean(v[k + '_end']) * scale:.{digits}f}"

        budget = ", ".join(str(b) for b in sorted(set(v["budget"])))
        lines.append(
            f"| {method_label(method)} | {labels} | {pair('accuracy', 100, 1)} | {pair('mean_confidence', 1, 3)} | "
            f"{pair('ece', 100, 1)} | {pair('nll', 1, 3)} | {np.mean(v['steps']):.0f} ({np.mean(v['best']):.0f}) "
            f"of {budget} | {sum(v['patience'])} of {len(v['patience'])} |"
        )
    return (
        [
            "Validation metrics of each trained run at its start and at its end (the kept state, before post-hoc "
            "steps; "
            "means over seeds; an ensemble's members averaged). MC-Dropout, Laplace and MAP+TS evaluate MAP's runs.",
            "",
        ]
        + lines
        + [""]
    )


def sigma_table(results: list[dict]) -> list[str]:
    """IB-EDL's per-question sigma (mean over options) on the in-distribution test set and each shifted stream, and
    the fitted zeta with the validation ECE it moved."""
    runs = [r for r in results if r["kind"] in ("id", "ood") and "sigma/median" in r["metrics"]]
    if not runs:
        return []
    lines = []
    rows: dict = defaultdict(lambda: defaultdict(list))
    streams: list[str] = []
    for r in runs:
        group = f"{method_label(r['method'])} ({r['kind']}{', noise' if r['label_noise'] else ''})"
        for k in ("median", "iqr", "cv"):
            rows[group][k].append(r["metrics"][f"sigma/{k}"])
        for key, value in r["metrics"].items():
            if key.endswith("/sigma_median"):
                stream = key.split("/")[1]
                streams += [stream] if stream not in streams else []
                rows[group][stream].append(value)
        t = r.get("training") or {}
        if r["kind"] == "id" and t.get("zeta") and t.get("validation_end") and t.get("validation_after_posthoc"):
            rows[group]["zeta"].append(t["zeta"].get("zeta", 0.0))
            rows[group]["ece_moved"].append(t["validation_after_posthoc"]["ece"] - t["validation_end"]["ece"])
    header = (
        ["Run", "median σ", "IQR", "CV"]
        + [f"median σ, {dataset_name(s)}" for s in streams]
        + ["ζ", "validation ECE (pts) moved by ζ"]
    )
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group, v in rows.items():
        cells = [f"{np.mean(v[k]):.3f}" if v.get(k) else "–" for k in ("median", "iqr", "cv", *streams)]
        cells += [f"{np.mean(v['zeta']):.2f}" if v.get("zeta") else "–",
                  f"{np.mean(v['ece_moved']) * 100:+.2f}" if v.get("ece_moved") else "–"]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return (
        [
            "IB-EDL's σ per question (its mean over the options) on the in-distribution test questions: median, "
            "interquartile range and coefficient of variation; then its median on each shifted stream; means over "
            "seeds.",
            "",
        ]
        + lines
        + [""]
    )


def ece_bins_table(results: list[dict]) -> list[str]:
    grouped = _group(results, "id")
    rows = {
        m: {f"ece_{b}": [v for d in grouped[m] for v in grouped[m][d].get(f"ece_{b}", [])] for b in (10, 15, 25, 35)}
        for m in grouped
    }
    return (
        ["ECE (%) ↓ with 10/15/25/35 bins, averaged over in-distribution datasets and seeds.", ""]
        + _table(
            rows,
            [f"ece_{b}" for b in (10, 15, 25, 35)],
            False,
            100,
            ["Method", "10 bins", "15 bins", "25 bins", "35 bins"],
        )
        + [""]
    )


def efficiency_table(results: list[dict]) -> list[str]:
    keys = EFFICIENCY_KEYS
    rows: dict = defaultdict(lambda: defaultdict(list))
    for r in results:
        for key in keys:
            value = r.get("efficiency", {}).get(key)
            if value:
                rows[r["method"]][key].append(value)
    methods = [m for m in METHODS if m in rows]
    mean = {m: {k: float(np.mean(rows[m][k])) if rows[m][k] else None for k in keys} for m in methods}
    ref = mean.get("map", {})

    def cell(m: str, k: str, fmt: str) -> str:
        value = mean[m][k]
        if value is None:
            return "–"
        ratio = f" ({value / ref[k]:.2f}x)" if ref.get(k) else ""
        return f"{value:{fmt}}{ratio}"

    lines = ["| Method | Train samples/s | Test samples/s | Peak train memory (MiB RSS) | Peak test memory (MiB RSS) |",
             "|---|---|---|---|---|"]
    for m in methods:
        lines.append(
            f"| {method_label(m)} | {cell(m, keys[0], '.2f')} | {cell(m, keys[1], '.2f')} | "
            f"{cell(m, keys[2], '.0f')} | "
            f"{cell(m, keys[3], '.0f')} |"
        )
    return ["Means over the grid's runs, with the ratio to MAP in brackets. MC-Dropout and Laplace reuse the MAP "
            "training run (their train columns repeat MAP's); Ens trains its members one after another; Laplace's test "
            "column leaves out its post-hoc fit (below). Runs side by side (`--jobs`) share the cores, and with "
            "`train_layers` the first run on a seed's questions (MAP's) also fills the prefix cache the others read: "
            "`python -m benchmarks.method_efficiency` measures one run at a time.", ""] + lines + [""] \
        + machines_lines(results)


def machines_lines(results: list[dict]) -> list[str]:
    """Which machines the speeds above were measured on, with each one's count of training and test measurements
    (cells from before the machine was recorded counted as not recorded): means over several machines mix them."""
    counts: dict = defaultdict(lambda: [0, 0])
    for r in results:
        eff = r.get("efficiency", {})
        for i, key in enumerate(("train_machine", "test_machine")):
            counts[eff.get(key) or "not recorded"][i] += 1
    listed = sorted(counts.items(), key=lambda kv: (kv[0] == "not recorded", kv[0]))
    return ["Measured on (cells' training, test speeds): "
            + "; ".join(f"{machine} ({train}, {test})" for machine, (train, test) in listed) + ".", ""]


def predictive_fit_table(results: list[dict]) -> list[str]:
    """What each predictive fit chose (Laplace's prior precision), what it cost and which cells and sets use it: an
    ood cell's in-distribution predictions come from its id cell's fit, its shifted streams from its own."""
    fits: dict = {}
    for r in sorted(results, key=lambda r: (list(METHODS).index(r["method"]), r["seed"], r["label_noise"], r["key"])):
        for fit in r.get("posthoc") or []:
            info = {k: v for k, v in fit.items() if k != "sets"}
            row = fits.setdefault((r["method"], r["seed"], r["label_noise"], json.dumps(info, sort_keys=True)),
                                  {"info": info, "cells": [], "sets": []})
            row["cells"] += [r["key"]] if r["key"] not in row["cells"] else []
            row["sets"] += [d for d in fit["sets"] if d not in row["sets"]]
    if not fits:
        return []

    def number(value, fmt: str) -> str:
        return "–" if value is None else f"{value:{fmt}}"

    lines = ["| Cells | Sets | Prior | Prior precision | Validation NLL | Validation NLL without it | Fit (s) |",
             "|---|---|---|---|---|---|---|"]
    for row in fits.values():
        p = row["info"]
        edge = f" (grid {p['at_grid_edge']})" if p.get("at_grid_edge") else ""
        lines.append(f"| {', '.join(row['cells'])} | {', '.join(row['sets'])} | {p.get('prior', '–')} | "
                     f"{number(p.get('prior_precision'), '.3g')}{edge} | {number(p.get('validation_nll'), '.3f')} | "
                     f"{number(p.get('validation_nll_map'), '.3f')} | {number(p.get('fit_seconds'), '.0f')} |")
    return ["Laplace's fits: the prior precision (`validation`: the grid value whose predictive has the lowest NLL on "
            "the run's validation questions; *grid top* means the narrowest posterior on the grid won, a predictive "
            "within a hair of MAP's) and the fit's seconds (curvature and prior choice, data loading left out). Each "
            "evaluation fits its own posterior: an ood cell reads its in-distribution predictions from the id cell "
            "of the same training run and fits again for the shifted streams.", ""] + lines + [""]


def _run_dir(runs_root: Path, r: dict) -> Path:
    """Where the benchmark wrote the run that evaluated record ``r`` (a method evaluated on another's run reads it)."""
    return runs_root / f"{r['dataset']}-{METHODS[r['method']].trained_as}-s{r['seed']}"


def _plotted_seed(records: dict, on_disk) -> int | None:
    """The lowest seed whose predictions are on disk (``on_disk(record)``) for every method in ``records``
    ({method: {seed: record}}), else None. Runs of another machine leave no predictions here, so the plots are
    drawn from a seed that ran on this one, the same seed for every method."""
    seeds = sorted(set.intersection(*(set(by_seed) for by_seed in records.values()))) if records else []
    return next((seed for seed in seeds if all(on_disk(by_seed[seed]) for by_seed in records.values())), None)


def plots(results: list[dict], runs_root: Path, out_dir: Path) -> list[Path]:
    """Per in-distribution dataset: risk-coverage of every method, and a reliability diagram per method, from the
    lowest seed whose predictions are on disk for every method. When no seed has them all, a method's plot is drawn
    from its lowest seed on disk, or kept as drawn before if it has none, and the risk-coverage plot is kept unless
    every method's predictions are there."""
    from ibedl.training.plots import reliability_diagram, risk_coverage_plot

    def pred_path(r: dict) -> Path:  # written by ibedl.training.experiments.benchmark (Runner.evaluate)
        return _run_dir(runs_root, r) / f"predictions-{r['method']}-{r['dataset']}.json"

    paths = []
    records: dict = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r["kind"] == "id":
            records[r["dataset"]][r["method"]].setdefault(r["seed"], r)
    for dataset, by_method in records.items():
        common = _plotted_seed(by_method, lambda r: pred_path(r).is_file())
        curves = {}
        for method in [m for m in METHODS if m in by_method]:
            path = out_dir / f"reliability-{dataset}-{method}.png"
            seeds = [common] if common is not None else sorted(by_method[method])
            found = next((by_method[method][s] for s in seeds if pred_path(by_method[method][s]).is_file()), None)
            if found is None:
                paths += [path] if path.is_file() else []
                continue
            s = json.loads(pred_path(found).read_text())
            conf = [max(p) for p in s["probs"]]
            hits = [float(int(np.argmax(p)) == y) for p, y in zip(s["probs"], s["labels"], strict=True)]
            curves[method_label(method)] = (conf, hits)
            title = f"{method_label(method)} on {DATASET_NAMES.get(dataset, dataset)}, seed {found['seed']}"
            paths.append(reliability_diagram(s["probs"], s["labels"], path, title=title))
        path = out_dir / f"risk-coverage-{dataset}.png"
        if curves and (common is not None or not path.is_file()):
            seed = f", seed {common}" if common is not None else ""
            paths.append(risk_coverage_plot(
                curves, path, title=f"Selective prediction on {DATASET_NAMES.get(dataset, dataset)}{seed} "
                                    "(score: max prob)"))
        elif path.is_file():
            paths.append(path)
    return paths + ood_plots(results, runs_root, out_dir)


OOD_PLOT_SCORES = {"max p": "probs", "1/u": "uncertainty", "-energy": "energy", "-Mahalanobis": "mahalanobis"}


def ood_plots(results: list[dict], runs_root: Path, out_dir: Path) -> list[Path]:
    """Per OOD experiment and method: the distribution of each OOD score (max probability, 1/u for Dirichlet
    methods, the energy and the Mahalanobis score, each oriented so higher is in-distribution) on the
    in-distribution stream and every shifted one, from the lowest seed whose predictions are on disk for every
    method. A plot whose predictions are gone is kept as drawn."""
    from ibedl.training.plots import score_distributions

    def files(r: dict) -> dict[str, Path]:
        shifted = dict.fromkeys(k.split("/")[1] for k in r["metrics"] if k.startswith("ood/"))
        return {s: _run_dir(runs_root, r) / f"predictions-{r['method']}-{s.replace(':', '-')}.json"
                for s in ([r["dataset"], *shifted] if shifted else [])}

    def on_disk(r: dict) -> bool:
        return bool(files(r)) and all(f.is_file() for f in files(r).values())

    paths = []
    records: dict = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r["kind"] == "ood":
            records[r["dataset"]][r["method"]].setdefault(r["seed"], r)
    for dataset, by_method in records.items():
        common = _plotted_seed(by_method, on_disk)
        for method in [m for m in METHODS if m in by_method]:
            path = out_dir / f"ood-scores-{dataset}-{method}.png"
            seeds = [common] if common is not None else sorted(by_method[method])
            found = next((by_method[method][s] for s in seeds if on_disk(by_method[method][s])), None)
            if found is None:
                paths += [path] if path.is_file() else []
                continue
            streams = {}
            for stream, file in files(found).items():
                preds = json.loads(file.read_text())
                scores = {}
                for label, key in OOD_PLOT_SCORES.items():
                    values = preds.get(key)
                    if values is None:
                        continue
                    if key == "probs":
                        scores[label] = [max(p) for p in values]
                    elif key == "uncertainty":
                        scores[label] = [1.0 / max(u, 1e-12) for u in values]
                    else:  # ibedl.training.ood_scores: energy and Mahalanobis are stored higher = in-distribution
                        scores[label] = list(values)
                streams[dataset_name(stream)] = scores
            paths.append(score_distributions(streams, path, title=f"{method_label(method)} trained on "
                                             f"{DATASET_NAMES.get(dataset, dataset)}, seed {found['seed']}: "
                                             "OOD scores per stream"))
    return paths


def coverage_table(results: list[dict]) -> list[str]:
    """Which seeds each method has per experiment: a grid that is still running (or was stopped) says so."""
    kinds = [k for k in ("id", "ood", "noise") if any(r["kind"] == k for r in results)]
    seeds = defaultdict(list)
    for r in results:
        seeds[(r["method"], r["kind"])].append(r["seed"])
    lines = ["| Method | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for m in [m for m in METHODS if any(r["method"] == m for r in results)]:
        lines.append(
            f"| {method_label(m)} | "
            + " | ".join(", ".join(map(str, sorted(set(seeds[(m, k)])))) or "–" for k in kinds)
            + " |"
        )
    return ["Seeds in this file per method and experiment (a missing seed has not run yet).", ""] + lines + [""]


def write_report(results: list[dict], config: dict, path: Path, runs_root: Path | None = None) -> list[Path]:
    """Write the Markdown report (and PNGs beside it when the runs' predictions exist)."""
    path = Path(path)
    seeds = sorted({r["seed"] for r in results})
    lines = [
        f"# Benchmark: {config.get('name', path.stem)}",
        "",
        f"Base model `{config.get('train', {}).get('base_model', '?')}`; seeds {seeds}; "
        f"mean ± std over seeds; best mean in bold. Command: `python -m ibedl.training.experiments.benchmark --config "
        f"{config.get('config_path', 'benchmarks/' + config.get('name', path.stem) + '.yaml')}`.",
        "",
    ]
    lines += ["## Runs", ""] + coverage_table(results)
    if any(r["kind"] == "id" for r in results):
        lines += (
            ["## In-distribution calibration", ""]
            + id_tables(results)
            + ["## ECE bin sensitivity", ""]
            + ece_bins_table(results)
        )
    if any(r["kind"] == "ood" for r in results):
        lines += ["## Out-of-distribution detection", ""] + ood_tables(results)
    if moved := training_table(results):
        lines += ["## Training: validation at the start and the end", ""] + moved
    if sigma := sigma_table(results):
        lines += ["## IB-EDL's σ", ""] + sigma
    if any(r["kind"] == "noise" for r in results):
        fraction = next(r["label_noise"] for r in results if r["kind"] == "noise")
        lines += [f"## Label noise ({fraction:.0%} of training labels moved; clean test data)", ""]
        lines += id_tables(results, "noise", ID_METRICS[:3])
    lines += ["## Efficiency", ""] + efficiency_table(results)
    if fits := predictive_fit_table(results):
        lines += ["## Post-hoc steps", ""] + fits
    written = [path]
    if runs_root is not None:
        images = plots(results, Path(runs_root), path.parent / f"{path.stem}-plots")
        if images:
            lines += ["## Plots", ""] + [f"![{p.stem}]({p.parent.name}/{p.name})" for p in images] + [""]
            written += images
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return written
