"""benchmarks/merged_adapter.py: a real run on the tiny adapter on this CPU (both ways on the same batches, the merged
one dispatching fewer operators and answering alike), and its arguments refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import merged_adapter


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "1"], "--rounds must be >= 2, got 1"),
    (["--batch-sizes", "1,0"], "--batch-sizes: expected positive integers, got '0'"),
    (["--batch-sizes", "one"], "--batch-sizes: expected positive integers, got 'one'"),
    (["--dtypes", "int8"], "--dtypes: expected float32, bfloat16 or float16, got ['int8']"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        merged_adapter.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_a_gpu_run_says_why(capsys):
    assert merged_adapter.main(["--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


def test_a_real_run_times_both_ways_on_the_same_batches(tiny_artifact, tmp_path):
    out = tmp_path / "m.json"
    assert merged_adapter.main(["--artifact", str(tiny_artifact), "--batch-sizes", "1,3", "--rounds", "2",
                                "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["precisions"]) == ["float32"] and result["device"]["cores"] >= 1
    row = result["precisions"]["float32"]
    assert row["agreement"]["questions"] == merged_adapter.AGREEMENT_QUESTIONS
    assert row["agreement"]["same_answer"] == 1.0 and row["agreement"]["largest_probability_difference"] < 1e-5
    assert 0 < row["agreement"]["largest_state_difference"] < 1e-5  # fp32 rounding apart: merged, not the same code
    assert list(row["batch_sizes"]) == ["1", "3"]
    for size, measured in row["batch_sizes"].items():
        assert measured["batches"] == 2 and measured["questions_per_batch"] == int(size)
        unmerged, merged = measured["unmerged"], measured["merged"]
        assert 0 < merged["operator_calls"] < unmerged["operator_calls"]  # the LoRA layers' own operators are gone
        assert measured["operator_calls_merged_over_unmerged"] == pytest.approx(
            merged["operator_calls"] / unmerged["operator_calls"])
        assert set(measured["merged_over_unmerged_time"]) == {"ratio", "low", "high"}
