"""benchmarks/paper_scale_gpu.py run for real in its CPU smoke mode (a 2-layer model of Llama3-8B's vocabulary): both
paths, both phases, the paper's figures beside them and one step of each under torch's profiler."""

from __future__ import annotations

import json

import pytest

from benchmarks import paper_scale_gpu


@pytest.mark.integration
def test_the_smoke_run_measures_both_paths_and_profiles_one_step_of_each(tmp_path, monkeypatch):
    from ibedl.core.base_model import resolve_model
    from ibedl.training.data import load_dataset
    from tests.conftest import shared_cache_dir

    monkeypatch.setenv("IBEDL_CACHE_DIR", shared_cache_dir())
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps([{"question": q.question, "options": list(q.options), "context": q.context,
                                      "answer": q.answer} for q in load_dataset("sciq", "train", limit=4, seed=0)]))
    out = tmp_path / "p.json"
    order, step = [], paper_scale_gpu.step

    def recorded(predictor, head, ids, batch, path, optimizer, train):
        order.append(path)
        return step(predictor, head, ids, batch, path, optimizer, train)

    monkeypatch.setattr(paper_scale_gpu, "step", recorded)
    assert paper_scale_gpu.main(["--smoke", "--questions", str(questions), "--tokenizer",
                                 str(resolve_model("smollm2-135m-instruct").path), "--batch-size", "2", "--steps", "2",
                                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu (smoke)" and result["paper"] == paper_scale_gpu.PAPER_H100
    # per phase: 2 warm-up steps of each path, the timed steps alternating (rows first, then full first), one
    # profiled step of each
    phase = ["rows", "rows", "full", "full", "rows", "full", "full", "rows", "rows", "full"]
    assert order == phase + phase
    for path in ("rows", "full"):
        for phase in ("train", "test"):
            entry = result["paths"][path]
            assert entry[f"{phase}_samples_per_s"] > 0
            ops = entry[f"{phase}_one_step_operators"]
            assert ops["operator_cpu_s"] > 0 and ops["kernel_s"] is None and ops["top_by_cpu"]  # no GPU here
    rows, full = result["paths"]["rows"], result["paths"]["full"]
    for phase in ("train", "test"):  # the same steps: the paired ratio of times is the ratio of samples/s
        ratio = result["rows_vs_full"][f"{phase}_samples_per_s"]
        assert ratio["ratio"] == pytest.approx(rows[f"{phase}_samples_per_s"] / full[f"{phase}_samples_per_s"])
        assert set(ratio) == {"ratio", "low", "high"}


def test_fewer_than_two_steps_are_refused(capsys):
    with pytest.raises(SystemExit):
        paper_scale_gpu.main(["--smoke", "--questions", "q.json", "--tokenizer", "t", "--steps", "1"])
    assert "--steps must be >= 2" in capsys.readouterr().err
