"""benchmarks/check_threads.py: a real run on the tiny adapter on this CPU (engines of one and two check threads
answering the same one-question requests around a stand-in trunk), and its arguments refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import check_threads


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "1"], "--rounds must be >= 2, got 1"),
    (["--clients", "0"], "--clients must be >= 1, got 0"),
    (["--threads", "2"], "--threads must list at least two distinct counts, got '2'"),
    (["--threads", "1,1"], "--threads must list at least two distinct counts, got '1,1'"),
    (["--threads", "1,x"], "--threads: expected positive integers, got 'x'"),
    (["--device", "tpu"], "--device must be cpu or cuda[:i], got 'tpu'"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        check_threads.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_a_gpu_run_says_why(capsys):
    assert check_threads.main(["--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


def test_a_real_run_answers_through_engines_of_each_thread_count_without_the_trunk(tiny_artifact, tmp_path,
                                                                                    monkeypatch):
    from ibedl.core.predictor import Predictor

    forwards = []
    monkeypatch.setattr(Predictor, "_hidden", lambda self, batch: forwards.append(batch))  # must not run
    out = tmp_path / "c.json"
    assert check_threads.main(["--artifact", str(tiny_artifact), "--threads", "1,2", "--clients", "3",
                               "--requests", "5", "--rounds", "2", "--dataset", "obqa", "--output", str(out)]) == 0
    assert forwards == []  # the stand-in answered every pass
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["cpu"]["cores"] >= 1 and result["settings"]["pad_freely"]
    assert (result["clients"], result["requests_per_round"], result["rounds"]) == (3, 5, 2)
    assert result["largest_probability_difference"] < 1e-5  # each answer its own prompt's, whatever the pass
    one, two = result["threads"]
    assert (one["check_threads"], two["check_threads"]) == (1, 2) and one["time_vs_first"] is None
    assert set(two["time_vs_first"]) == {"ratio", "low", "high"} and two["time_vs_first"]["ratio"] > 0
    for row in (one, two):
        assert row["answers_per_s"] > 0 and row["cpu_ms_per_answer"] > 0
        assert set(row["cpu_ms_per_answer_by_thread"]) == {"check", "model", "event_loop", "caller", "other"}


def test_the_stand_in_answers_each_prompt_by_its_own_tokens_whatever_its_pass(tiny_artifact):
    """The stand-in's state for a prompt depends on that prompt's ids alone: padded in a pass of others or alone, one
    question gets the same probabilities (what lets the run compare two engines' answers); another prompt others."""
    from ibedl.core.prompt import MCQuestion
    from ibedl.engine.settings import EngineSettings

    (predictor,) = check_threads.stand_in_loader()(EngineSettings(artifact=tiny_artifact, backend="torch"))
    short = MCQuestion("Which is sun?", ("sun", "moon"))
    long = MCQuestion("Which of these shines in the sky by day and warms the earth?", ("sun", "moon", "tree"))
    alone = predictor.predict([short], False)[0]
    padded = predictor.predict([long, short], False)[1]
    assert padded.probs == pytest.approx(alone.probs, abs=1e-6)
    other = predictor.predict([MCQuestion("Which is moon?", ("sun", "moon"))], False)[0]
    assert other.probs != pytest.approx(alone.probs, abs=1e-3)  # another prompt, another state


def test_a_run_cut_short_keeps_the_rounds_it_finished(tiny_artifact, tmp_path, monkeypatch):
    """The file is written after every timed round (a lent GPU's call may be cut at its limit): the second timed
    round failing leaves the first's record, with no interval yet from one round."""
    burst, calls = check_threads.burst, []

    def failing(engine, requests, clients):
        calls.append(len(requests))
        if len(calls) == 5:  # round 0 and round 1 ran on both engines
            raise RuntimeError("cut short")
        return burst(engine, requests, clients)

    monkeypatch.setattr(check_threads, "burst", failing)
    out = tmp_path / "c.json"
    with pytest.raises(RuntimeError, match="cut short"):
        check_threads.main(["--artifact", str(tiny_artifact), "--threads", "1,2", "--clients", "2", "--requests", "3",
                            "--rounds", "3", "--dataset", "obqa", "--output", str(out)])
    result = json.loads(out.read_text())
    assert result["rounds"] == 1 and [row["time_vs_first"] for row in result["threads"]] == [None, None]
    assert all(row["answers_per_s"] > 0 for row in result["threads"])
