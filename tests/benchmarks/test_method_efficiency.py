"""The per-method efficiency benchmark on the tiny model: one run at a time, ratios to MAP, reused training."""

import json
import os

import pytest

from benchmarks.method_efficiency import main, table, with_ratios


@pytest.fixture
def tiny_grid(tmp_path, tiny_model_dir):
    config = {
        "name": "tiny", "methods": ["map", "mc_dropout", "edl"], "seeds": [0],
        "train": {"base_model": str(tiny_model_dir), "max_tokens": 512, "eval_batch_size": 8,
                  "optim": {"max_steps": 2, "batch_size": 4}, "lora": {"targets": ["q_proj", "v_proj"]}},
        "method_params": {"mc_dropout": {"mc_samples": 2}},
        "experiments": [{"kind": "id", "datasets": ["sciq"]}],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def test_ratios_to_map_and_reused_training(tiny_grid, tmp_path, capsys):
    out = tmp_path / "eff.json"
    assert main(["--config", str(tiny_grid), "--train", "8", "--validation", "8", "--test", "8",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert list(methods) == ["map", "mc_dropout", "edl"] and result["sizes"] == {"train": 8, "validation": 8, "test": 8}
    assert result["cpu"]["model"] and result["cpu"]["cores"] == len(os.sched_getaffinity(0))  # each speed's CPU
    assert set(methods["map"]["ratio_to_map"]) >= {"train_samples_per_s", "test_samples_per_s", "train_seconds"}
    edl, mcd, ref = methods["edl"], methods["mc_dropout"], methods["map"]
    for key in ("train_samples_per_s", "test_samples_per_s", "train_peak_rss_mib", "eval_peak_rss_mib"):
        assert edl[key] > 0 and edl["ratio_to_map"][key] == pytest.approx(edl[key] / ref[key])
    # MC-Dropout is evaluated on MAP's training run: the same training numbers, its own test pass
    assert mcd["reuses_training_of"] == "map" and edl["reuses_training_of"] is None
    assert mcd["train_samples_per_s"] == ref["train_samples_per_s"] and mcd["train_samples"] == ref["train_samples"]
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[1:4]] == ["map", "mc_dropout", "edl"]
    assert printed[-1] == f"wrote {out}"


def test_missing_numbers_show_as_a_dash_not_an_error():
    methods = with_ratios({
        "map": {"train_samples_per_s": 4.0, "test_samples_per_s": 10.0, "train_peak_rss_mib": 800.0,
                "eval_peak_rss_mib": 700.0},
        "laplace": {"train_samples_per_s": 4.0, "test_samples_per_s": 2.5, "train_peak_rss_mib": None,
                    "eval_peak_rss_mib": 1400.0},
    })
    assert methods["laplace"]["ratio_to_map"] == {"train_samples_per_s": 1.0, "test_samples_per_s": 0.25,
                                                  "eval_peak_rss_mib": 2.0}
    row = table(methods).splitlines()[2].split()
    assert row == ["laplace", "4.00", "1.00", "2.50", "0.25", "–", "–", "1400", "2.00"]


def test_bad_arguments_are_reported(tiny_grid, capsys):
    assert main(["--config", str(tiny_grid), "--methods", "nope"]) == 2
    assert "unknown methods ['nope']" in capsys.readouterr().err
    assert main(["--config", str(tiny_grid), "--test", "2"]) == 2
    assert "--test must be >= 8, got 2" in capsys.readouterr().err
