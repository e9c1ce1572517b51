"""The option-rows benchmark end to end on the tiny model: both training paths timed, each path's memory measured in
its own child process (run as a module, the repository on its PYTHONPATH, in the caller's directory), the CPU
recorded."""

import json

import pytest

from benchmarks.option_rows import main
from ibedl.training.data import data_dir

pytestmark = pytest.mark.skipif(not (data_dir() / "sciq").is_dir(),
                                reason=f"SciQ not found under {data_dir()} (set IBEDL_DATA_DIR to run this test)")


def test_rows_and_full_logits_measured_with_memory_children(tiny_model_dir, tmp_path):
    out = tmp_path / "option_rows.json"
    assert main(["--base-model", str(tiny_model_dir), "--rounds", "1", "--batch-size", "2", "--template", "plain-v1",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["train_samples_per_s"]) == {"rows", "full"} and min(result["train_samples_per_s"].values()) > 0
    assert set(result["train_peak_memory_mib"]) == {"rows", "full"}  # one child process per path answered
    assert result["train_speedup_rows_vs_full"] == pytest.approx(
        result["train_samples_per_s"]["rows"] / result["train_samples_per_s"]["full"])
    assert result["inference_ratio_vs_map"]["map"] == pytest.approx(1.0)
    assert result["cpu"]["model"] and result["cpu"]["cores"] >= 1
