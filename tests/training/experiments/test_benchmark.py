"""The benchmark runner end to end on the tiny model: id, ood and noise experiments, resume, report."""

import json

import pytest

from training.experiments.benchmark import Run, expand, main


@pytest.fixture
def bench_config(tmp_path, tiny_model_dir):
    config = {
        "name": "tiny",
        "train": {"base_model": str(tiny_model_dir), "max_tokens": 512, "eval_batch_size": 8,
                  "optim": {"max_steps": 2, "batch_size": 4}, "lora": {"targets": ["q_proj", "v_proj"]}},
        "methods": ["map", "mc_dropout", "ib_edl"],
        "method_params": {"mc_dropout": {"mc_samples": 2}, "ib_edl": {"num_samples": 2}},
        "seeds": [0],
        "sizes": {"default": {"train": 8, "validation": 8, "test": 6}},
        "experiments": [
            {"kind": "id", "datasets": ["sciq", "obqa"]},
            {"kind": "ood", "train": "obqa", "ood": ["arc_easy"]},
            {"kind": "noise", "datasets": ["arc_easy"], "fraction": 0.5},
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path, config


def test_expand_grid(bench_config):
    _, config = bench_config
    runs = expand({**config, "seeds": [0, 1]})
    assert len(runs) == 4 * 3 * 2
    assert Run("id", "id", "sciq", "ib_edl", 1, ("sciq",)) in runs
    noise = [r for r in runs if r.kind == "noise"]
    assert all(r.label_noise == 0.5 and r.key.startswith("noise-arc_easy-noise0.5-") for r in noise)
    with pytest.raises(ValueError, match="unknown methods"):
        expand({**config, "methods": ["map", "nope"]})


def test_runner_end_to_end_and_resume(bench_config, tmp_path):
    path, _ = bench_config
    runs_dir, results = tmp_path / "runs", tmp_path / "tiny-results.json"
    args = ["--config", str(path), "--runs-dir", str(runs_dir), "--results", str(results)]
    assert main(args) == 0
    data = json.loads(results.read_text())
    assert len(data) == 12
    # the ood cell reuses the id training run of OBQA: 4 trained datasets x 2 trained methods
    assert len(list(runs_dir.glob("*/manifest.json"))) == 6
    by_key = {r["key"]: r for r in data}
    assert set(by_key["id-sciq-ib_edl-s0"]["metrics"]) >= {"accuracy", "ece", "nll", "brier", "aurc", "ece_35"}
    ood = by_key["ood-obqa-ib_edl-s0"]["metrics"]
    assert 0 <= ood["ood/arc_easy/auroc_mp"] <= 1 and 0 <= ood["ood/arc_easy/auroc_um"] <= 1
    assert "ood/arc_easy/auroc_um" not in by_key["ood-obqa-map-s0"]["metrics"]
    # MC-Dropout and Laplace-style post-hoc methods reuse the MAP training run
    assert not (runs_dir / "sciq-mc_dropout-s0").exists()
    assert (runs_dir / "sciq-map-s0" / "predictions-id-mc_dropout.json").is_file()
    manifest = json.loads((runs_dir / "arc_easy-noise0.5-map-s0" / "manifest.json").read_text())
    assert manifest["training"]["label_noise"] == 0.5
    report = results.with_suffix(".md").read_text()
    assert "## Label noise (50% of training labels moved; clean test data)" in report
    assert (tmp_path / "tiny-results-plots" / "risk-coverage-sciq.png").is_file()

    # Resume: nothing is retrained; a lost result is rebuilt from its cached predictions.
    stamps = {p: p.stat().st_mtime for p in runs_dir.glob("*/manifest.json")}
    results.write_text(json.dumps([r for r in data if r["key"] != "id-sciq-ib_edl-s0"]))
    assert main(args) == 0
    again = json.loads(results.read_text())
    assert len(again) == 12
    assert {p: p.stat().st_mtime for p in runs_dir.glob("*/manifest.json")} == stamps
    rebuilt = {r["key"]: r for r in again}["id-sciq-ib_edl-s0"]
    assert rebuilt["metrics"] == by_key["id-sciq-ib_edl-s0"]["metrics"]


def test_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmethods: [map]\nseeds: [0]\nexperiments: [{kind: weird}]\n")
    assert main(["--config", str(bad)]) == 2
    assert "experiment kind must be id, ood or noise" in capsys.readouterr().err
