"""benchmarks/pass_overhead.py: a real run on the tiny adapter on this CPU (each size's passes timed around a
stand-in trunk, both ways of each step on the same questions), and its arguments refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import pass_overhead


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "1"], "--rounds must be >= 2 (a paired interval needs two rounds), got 1"),
    (["--sizes", "1,0"], "--sizes: expected positive integers, got '0'"),
    (["--device", "tpu"], "--device must be cpu or cuda[:i], got 'tpu'"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        pass_overhead.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_a_gpu_run_says_why(capsys):
    assert pass_overhead.main(["--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


def test_a_real_run_times_the_passes_without_the_trunk_and_both_ways_of_each_step(tiny_artifact, tmp_path,
                                                                                  monkeypatch):
    from ibedl.core.predictor import Predictor

    forwards = []
    monkeypatch.setattr(Predictor, "_hidden", lambda self, batch: forwards.append(batch))  # must not run
    out = tmp_path / "p.json"
    assert pass_overhead.main(["--artifact", str(tiny_artifact), "--sizes", "1,3", "--rounds", "2",
                               "--dataset", "obqa", "--output", str(out)]) == 0  # short: within its 96 tokens
    assert forwards == []  # the stand-in answered every pass
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["cpu"]["cores"] >= 1
    assert [row["questions_per_pass"] for row in result["sizes"]] == [1, 3]
    for row in result["sizes"]:
        assert row["rounds"] == 2 and row["pass_ms_outside_trunk"] > 0
        assert row["question_ms_outside_trunk"] == pytest.approx(row["pass_ms_outside_trunk"]
                                                                 / row["questions_per_pass"])
        assert row["checked_pass_ms_outside_trunk"] > 0
        for key in ("tokenise_one_call_vs_one_by_one", "activate_check_vs_set_adapter", "checked_pass_vs_pass"):
            assert set(row[key]) == {"ratio", "low", "high"} and row[key]["ratio"] > 0
