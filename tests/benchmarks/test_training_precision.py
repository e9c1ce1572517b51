"""benchmarks/training_precision.py: the precisions it runs by device, its arguments refused by name, and a real run on
the CPU (fp32 and bf16 on the same batches, one profiled pass each)."""

from __future__ import annotations

import json

import pytest

from benchmarks import training_precision


def test_precisions_default_by_device_fp32_first_and_cuda_only_ones_refused_on_a_cpu():
    assert training_precision.parse_precisions(None, "cpu") == ["fp32", "bf16"]
    assert training_precision.parse_precisions(None, "cuda") == ["fp32", "bf16", "bf16-autocast"]
    assert training_precision.parse_precisions("bf16-autocast,bf16", "cuda") == ["fp32", "bf16-autocast", "bf16"]
    with pytest.raises(ValueError, match="bf16-autocast runs on CUDA only"):
        training_precision.parse_precisions("bf16-autocast", "cpu")
    with pytest.raises(ValueError, match=r"unknown \['fp8'\]"):
        training_precision.parse_precisions("fp8", "cpu")


@pytest.mark.parametrize(("argv", "says"), [(["--steps", "1"], "--steps >= 2"),
                                            (["--batch-size", "0"], "--batch-size must be >= 1"),
                                            (["--device", "tpu"], "--device must be cpu or cuda, got 'tpu'"),
                                            (["--precisions", "bf16-autocast"], "runs on CUDA only")])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit):
        training_precision.main(argv)
    assert says in capsys.readouterr().err


@pytest.mark.integration
def test_each_precision_runs_on_the_same_batches_and_is_profiled(tmp_path, monkeypatch):
    from tests.conftest import shared_cache_dir

    monkeypatch.setenv("IBEDL_CACHE_DIR", shared_cache_dir())
    out = tmp_path / "tp.json"
    assert training_precision.main(["--batch-size", "2", "--steps", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"]["cores"] >= 1 and result["batches"] == 2 and result["method"] == "ib_edl"
    fp32, bf16 = result["precisions"]["fp32"], result["precisions"]["bf16"]
    assert fp32["gradient_max_rel_diff_vs_fp32"] == 0.0 and 0 < bf16["gradient_max_rel_diff_vs_fp32"] < 1
    assert fp32["vs_fp32_time"] is None and set(bf16["vs_fp32_time"]) == {"ratio", "low", "high"}
    # PEFT keeps the adapter in float32 on a bf16 base: its casts make a bf16 pass dispatch more operators
    assert bf16["one_pass_operators"]["operator_calls"] > fp32["one_pass_operators"]["operator_calls"] > 1000
    unlike = bf16["one_pass_operators"]["calls_unlike_fp32"]
    assert unlike["aten::to"][1] > unlike["aten::to"][0] and "calls_unlike_fp32" not in fp32["one_pass_operators"]
    assert fp32["one_pass_operators"]["kernel_s"] is None and fp32["pass_peak_above_start_mib"] is None  # CUDA's
