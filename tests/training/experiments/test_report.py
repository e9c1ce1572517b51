"""The report generator on a small synthetic results file."""

import json
import shutil
from pathlib import Path

import numpy as np

from ibedl.training.experiments.report import efficiency_table, write_report


def synthetic_results():
    rng = np.random.default_rng(0)
    results = []
    for method, acc in (("map", 0.80), ("ib_edl", 0.81), ("edl", 0.70)):
        for seed in (0, 1):
            for dataset in ("sciq", "obqa"):
                results.append({
                    "key": f"id-{dataset}-{method}-s{seed}", "kind": "id", "experiment": "id", "method": method,
                    "dataset": dataset, "seed": seed, "label_noise": 0.0,
                    "metrics": {"accuracy": acc + seed * 0.01, "ece": 0.1 if method == "map" else 0.05 + seed * 0.01,
                                "nll": 0.6, "brier": 0.3, "aurc": 0.1, "acc@80": 0.85, "acc@90": 0.83,
                                **{f"ece_{b}": 0.05 * (method != "ib_edl") + 0.02 for b in (10, 15, 25, 35)}},
                    "efficiency": {"train_samples_per_s": 2.0, "test_samples_per_s": 5.0, "train_peak_rss_mib": 3000},
                })
            results.append({
                "key": f"ood-obqa-{method}-s{seed}", "kind": "ood", "experiment": "ood", "method": method,
                "dataset": "obqa", "seed": seed, "label_noise": 0.0,
                "metrics": {"accuracy": 0.5, "ece": 0.1, "nll": 1.0, "ood/sciq/auroc_mp": 0.6 + rng.random() * 0.01,
                            **({"ood/sciq/auroc_um": 0.9} if method != "map" else {})},
                "efficiency": {},
            })
    return results


def test_report_layout_and_bold_best(tmp_path):
    path = tmp_path / "bench.md"
    written = write_report(synthetic_results(), {"name": "bench", "train": {"base_model": "tiny"}}, path)
    assert written == [path]
    text = path.read_text()
    assert "## In-distribution calibration" in text and "## Out-of-distribution detection" in text
    acc_table = text.split("**Acc (%) ↑**")[1].split("**ECE")[0]
    # IB-EDL has the best mean accuracy on both datasets: 81.50 ± 0.50
    assert "| IB-EDL | **81.50 ± 0.50** | **81.50 ± 0.50** |" in acc_table
    ece_table = text.split("**ECE (%) ↓**")[1].split("**NLL")[0]
    assert "| MAP | 10.00 ± 0.00 |" in ece_table and "**5.50 ± 0.50**" in ece_table
    # methods without a Dirichlet have no UM column value
    ood = text.split("## Out-of-distribution detection")[1]
    um = ood.split("AUROC (%) ↑ by 1/u (UM)")[1].split("AUROC")[0].split("##")[0]
    assert "| Method | SciQ | mean |" in um and "| MAP |" not in um and "| EDL |" in um
    assert "## Efficiency" in text


def test_report_rows_without_posthoc_and_matched_ood(tmp_path):
    results = synthetic_results()
    for r in results:
        if r["method"] == "ib_edl":
            r["metrics_without_posthoc"] = {**r["metrics"], "ece": 0.2}
        if r["kind"] == "ood":
            r["metrics"].update({"ood/sciq:no_context/auroc_mp_matched": 0.7, "ood/sciq:no_context/matched_options": 4})
        if r["kind"] == "id" and r["method"] == "map":
            r["efficiency"]["test_samples_per_s"] = 10.0
    path = tmp_path / "bench.md"
    write_report(results, {"name": "bench"}, path)
    text = path.read_text()
    ece_table = text.split("**ECE (%) ↓**")[1].split("**NLL")[0]
    lines = ece_table.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("| IB-EDL |")][0]
    assert lines[at + 1].startswith("| IB-EDL, ζ = 0 | 20.00 ± 0.00 |")  # right after the method, zeta undone
    ood = text.split("## Out-of-distribution detection")[1]
    assert "option count matched (both sides restricted to 4-option questions)" in ood
    mp = ood.split("AUROC (%) ↑ by max probability (MP)")[1].split("AUROC")[0]
    assert "| Method | SciQ | SciQ (no passage) | mean |" in mp
    matched = ood.split("option count matched")[1].split("##")[0]
    assert "| Method | MP |" in matched and "| MAP | **70.00 ± 0.00** |" in matched
    eff = text.split("## Efficiency")[1]
    assert "| MAP | 2.00 (1.00x) |" in eff and "| IB-EDL | 2.00 (1.00x) | 5.00 (0.50x) |" in eff


def test_report_lists_the_seeds_each_method_has(tmp_path):
    results = [r for r in synthetic_results() if not (r["method"] == "edl" and r["seed"] == 1)]
    path = tmp_path / "bench.md"
    write_report(results, {"name": "bench"}, path)
    runs = path.read_text().split("## Runs")[1].split("##")[0]
    assert "| Method | id | ood |" in runs
    assert "| EDL | 0 | 0 |" in runs and "| IB-EDL | 0, 1 | 0, 1 |" in runs


def write_predictions(runs: Path, dataset: str, method: str, rng, seed: int = 0) -> None:
    probs = rng.dirichlet(np.ones(4), size=20)
    out = runs / f"{dataset}-{method}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"predictions-{method}-{dataset}.json").write_text(
        json.dumps({"probs": probs.tolist(), "labels": rng.integers(0, 4, size=20).tolist()}))


def test_report_keeps_plots_whose_predictions_are_gone(tmp_path):
    """Plots are drawn from the runs' predictions; a method whose runs are not on this machine keeps the plot drawn
    before, and the risk-coverage plot is only redrawn when every method's predictions are there."""
    rng = np.random.default_rng(1)
    results = [r for r in synthetic_results() if r["dataset"] == "sciq"]
    runs, path = tmp_path / "runs", tmp_path / "bench.md"
    plots = tmp_path / "bench-plots"
    for method in ("map", "ib_edl", "edl"):
        write_predictions(runs, "sciq", method, rng)
    write_report(results, {"name": "bench"}, path, runs)
    drawn = {p.name: p.read_bytes() for p in plots.iterdir()}
    assert set(drawn) == {"reliability-sciq-map.png", "reliability-sciq-ib_edl.png", "reliability-sciq-edl.png",
                          "risk-coverage-sciq.png"}
    shutil.rmtree(runs / "sciq-edl-s0")
    write_predictions(runs, "sciq", "map", rng)  # MAP trained again: new predictions
    written = write_report(results, {"name": "bench"}, path, runs)
    assert {p.name for p in written[1:]} == set(drawn)
    assert plots.joinpath("reliability-sciq-edl.png").read_bytes() == drawn["reliability-sciq-edl.png"]
    assert plots.joinpath("risk-coverage-sciq.png").read_bytes() == drawn["risk-coverage-sciq.png"]
    assert plots.joinpath("reliability-sciq-map.png").read_bytes() != drawn["reliability-sciq-map.png"]
    assert "![reliability-sciq-edl](bench-plots/reliability-sciq-edl.png)" in path.read_text()


def test_report_draws_the_plots_from_the_lowest_seed_every_method_has_on_disk(tmp_path, monkeypatch):
    """Seed 0 ran on another machine (no predictions here) and seed 1 here: every plot is drawn from seed 1, the
    same seed for every method, and says so; with seed 0 back for every method, seed 0 is drawn."""
    import ibedl.training.plots as plots_module

    titles = {}
    draw = plots_module.reliability_diagram

    def recording(probs, labels, path, title):
        titles[Path(path).name] = title
        return draw(probs, labels, path, title=title)

    monkeypatch.setattr(plots_module, "reliability_diagram", recording)
    rng = np.random.default_rng(3)
    results = [r for r in synthetic_results() if r["dataset"] == "sciq"]
    runs, path = tmp_path / "runs", tmp_path / "bench.md"
    for method in ("map", "ib_edl", "edl"):
        write_predictions(runs, "sciq", method, rng, seed=1)
    write_predictions(runs, "sciq", "map", rng, seed=0)  # one method's seed 0 alone: not a common seed
    written = write_report(results, {"name": "bench"}, path, runs)
    assert {p.name for p in written[1:]} == {"reliability-sciq-map.png", "reliability-sciq-ib_edl.png",
                                             "reliability-sciq-edl.png", "risk-coverage-sciq.png"}
    assert titles == {"reliability-sciq-map.png": "MAP on SciQ, seed 1",
                      "reliability-sciq-ib_edl.png": "IB-EDL on SciQ, seed 1",
                      "reliability-sciq-edl.png": "EDL on SciQ, seed 1"}
    for method in ("ib_edl", "edl"):
        write_predictions(runs, "sciq", method, rng, seed=0)
    write_report(results, {"name": "bench"}, path, runs)
    assert set(titles.values()) == {"MAP on SciQ, seed 0", "IB-EDL on SciQ, seed 0", "EDL on SciQ, seed 0"}


def test_report_lists_what_each_post_hoc_step_chose(tmp_path):
    results = synthetic_results()
    own = {"prior": "validation", "prior_precision": 177.8279, "at_grid_edge": None, "validation_nll": 0.3412,
           "validation_nll_map": 0.3523, "fit_seconds": 241.4}
    ood = {**own, "prior_precision": 1e6, "at_grid_edge": "top", "fit_seconds": 250.2}
    cell = {"kind": "id", "experiment": "id", "method": "laplace", "dataset": "sciq", "seed": 0, "label_noise": 0.0,
            "metrics": results[0]["metrics"], "efficiency": {}}
    results += [{**cell, "key": "id-sciq-laplace-s0", "posthoc": [{**own, "sets": ["sciq"]}]},
                {**cell, "key": "ood-sciq-laplace-s0", "kind": "ood", "experiment": "ood",
                 "posthoc": [{**own, "sets": ["sciq"]}, {**ood, "sets": ["obqa", "arc_easy"]}]}]
    path = tmp_path / "bench.md"
    write_report(results, {"name": "bench"}, path)
    rows = [line for line in path.read_text().split("## Post-hoc steps")[1].splitlines() if "laplace" in line]
    # one row per fit: the id cell's, which the ood cell also reads, and the ood cell's own
    assert rows == ["| id-sciq-laplace-s0, ood-sciq-laplace-s0 | sciq | validation | 178 | 0.341 | 0.352 | 241 |",
                    "| ood-sciq-laplace-s0 | obqa, arc_easy | validation | 1e+06 (grid top) | 0.341 | 0.352 | 250 |"]
    write_report(synthetic_results(), {"name": "bench"}, path)
    assert "## Post-hoc steps" not in path.read_text()


def test_report_shows_training_start_and_end_and_ib_edl_sigma(tmp_path):
    results = synthetic_results()
    for r in results:
        if r["kind"] != "id" or r["dataset"] != "sciq":
            continue
        start = {"accuracy": 0.5, "mean_confidence": 0.6, "ece": 0.2, "nll": 1.0, "brier": 0.5}
        end = {"accuracy": 0.7 + r["seed"] * 0.1, "mean_confidence": 0.75, "ece": 0.05, "nll": 0.7, "brier": 0.4}
        r["training"] = {"validation_start": start, "validation_end": end, "steps": [40], "best_steps": [30],
                         "budget_steps": 100, "stopped_by": ["patience" if r["seed"] else "budget"],
                         "zeta": {"zeta": 0.5} if r["method"] == "ib_edl" else None,
                         "validation_after_posthoc": {**end, "ece": 0.04}}
        if r["method"] == "ib_edl":
            r["metrics"].update({"sigma/median": 0.6 + r["seed"] * 0.2, "sigma/iqr": 0.3, "sigma/cv": 0.4})
    results.append({**results[-1], "kind": "ood", "key": "ood-sciq-ib_edl-s0", "method": "ib_edl", "training": None,
                    "metrics": {"sigma/median": 0.7, "sigma/iqr": 0.3, "sigma/cv": 0.4, "ood/obqa/sigma_median": 1.5}})
    path = tmp_path / "bench.md"
    write_report(results, {"name": "bench"}, path)
    text = path.read_text()
    moved = text.split("## Training: validation at the start and the end")[1].split("##")[0]
    # mean over seeds 0 and 1: accuracy 70% and 80% at the end
    assert (
        "| IB-EDL | clean | 50.0 → 75.0 | 0.600 → 0.750 | 20.0 → 5.0 | 1.000 → 0.700 | 40 (30) of 100 | 1 of 2 |"
        in moved
    )
    sigma = text.split("## IB-EDL's σ")[1].split("##")[0]
    assert "| IB-EDL (id) | 0.700 | 0.300 | 0.400 | – | 0.50 | -1.00 |" in sigma
    assert "| IB-EDL (ood) | 0.700 | 0.300 | 0.400 | 1.500 | – | – |" in sigma


def test_report_draws_each_methods_ood_scores_per_stream(tmp_path):
    """An ood cell gets one figure of its scores' distributions on every stream its metrics name; a Dirichlet
    method's panel for 1/u is there, a softmax method's is not; without every stream's predictions no plot."""
    from PIL import Image

    rng = np.random.default_rng(2)
    runs, path = tmp_path / "runs", tmp_path / "bench.md"
    streams = ["sciq", "sciq:no_context", "obqa"]
    results = []
    for method in ("map", "ib_edl"):
        metrics = {"accuracy": 0.8, **{f"ood/{s}/auroc_mp": 0.7 for s in streams[1:]}}
        results.append({"key": f"ood-sciq-{method}-s0", "kind": "ood", "experiment": "ood", "method": method,
                        "dataset": "sciq", "seed": 0, "label_noise": 0.0, "metrics": metrics, "efficiency": {}})
        out = runs / f"sciq-{method}-s0"
        out.mkdir(parents=True)
        for s in streams:
            n = 30
            preds = {"probs": rng.dirichlet(np.ones(4), size=n).tolist(), "labels": [0] * n,
                     "uncertainty": rng.uniform(0.1, 0.9, n).tolist() if method == "ib_edl" else None,
                     "energy": rng.normal(size=n).tolist(), "mahalanobis": rng.normal(size=n).tolist()}
            (out / f"predictions-{method}-{s.replace(':', '-')}.json").write_text(json.dumps(preds))
    written = write_report(results, {"name": "bench"}, path, runs)
    names = {p.name for p in written[1:]}
    assert names == {"ood-scores-sciq-map.png", "ood-scores-sciq-ib_edl.png"}
    widths = {n: Image.open(tmp_path / "bench-plots" / n).size[0] for n in names}
    assert widths["ood-scores-sciq-ib_edl.png"] > widths["ood-scores-sciq-map.png"]  # four panels against three
    assert "![ood-scores-sciq-ib_edl](bench-plots/ood-scores-sciq-ib_edl.png)" in path.read_text()
    (runs / "sciq-map-s0" / "predictions-map-obqa.json").unlink()
    (tmp_path / "bench-plots" / "ood-scores-sciq-map.png").unlink()
    assert "ood-scores-sciq-map.png" not in {p.name for p in write_report(results, {"name": "bench"}, path, runs)}


def test_the_efficiency_table_names_the_machines_its_speeds_were_measured_on():
    results = [{"method": "map", "efficiency": {"train_samples_per_s": 2.0, "train_machine": "cpu A",
                                                 "test_machine": "cpu B"}},
               {"method": "ib_edl", "efficiency": {"train_samples_per_s": 1.0, "train_machine": "cpu A"}},
               {"method": "edl", "efficiency": {}}]
    lines = efficiency_table(results)
    assert "Measured on (cells' training, test speeds): cpu A (2, 0); cpu B (0, 1); not recorded (1, 2)." in lines
