"""The feedback replay's bookkeeping on synthetic streams: labels read in arrival order, the alarm counted in
labelled answered questions of the shifted stream only, and the adaptive sets' delayed threshold."""

import numpy as np
import pytest

from benchmarks.feedback_replay import first_alarms, history, replay_seed, summary


def stream(n: int, correct: bool, label_score: float) -> dict:
    """n questions, all answered, all right or all wrong; 3 options whose scores put the label at label_score."""
    scores = [np.array([0.05, 0.5, 0.9]) for _ in range(n)]
    return {"answered": np.ones(n, dtype=bool), "correct": np.full(n, correct), "covered": np.full(n, correct),
            "size": np.ones(n, dtype=np.int64), "label_score": np.full(n, label_score),
            "label_is_top": np.full(n, label_score == 0.05), "scores": scores}


def test_labels_arrive_late_but_each_once():
    rng = np.random.default_rng(0)
    run = replay_seed(rng, stream(50, True, 0.05), stream(50, False, 0.9), 50, 50, delay=10, quantile=0.3,
                      rate=0.05, target_cov=0.9)
    assert len(run["answered"]) == 100 and run["shifted"].sum() == 50
    assert run["correct"].sum() == 50 and not run["correct"][run["shifted"]].any()
    # labels up to 10 questions late: some shifted labels arrive before the last in-distribution ones
    assert np.any(np.diff(run["shifted"].astype(int)) < 0)
    no_delay = replay_seed(rng, stream(50, True, 0.05), stream(50, False, 0.9), 50, 50, delay=0, quantile=0.3,
                           rate=0.05, target_cov=0.9)
    assert np.all(np.diff(no_delay["shifted"].astype(int)) >= 0)


def test_adaptive_threshold_widens_after_the_shift():
    rng = np.random.default_rng(1)
    run = replay_seed(rng, stream(30, True, 0.05), stream(300, False, 0.9), 30, 300, delay=0, quantile=0.3,
                      rate=0.05, target_cov=0.9)
    covered = run["adaptive_covered"]
    assert covered[:30].all()  # in distribution the label is the top option
    assert not covered[30:35].any()  # the first shifted labels fall outside (score 0.9 > 0.3)
    assert covered[-50:].mean() > 0.5  # the threshold has grown past 0.9: the sets now hold the label
    assert run["adaptive_size"][-1] == 3


def test_alarm_counts_labelled_answered_shifted_questions():
    rng = np.random.default_rng(2)
    runs = [replay_seed(rng, stream(300, True, 0.05), stream(200, False, 0.9), 300, 200, delay=0, quantile=0.3,
                        rate=0.01, target_cov=0.9) for _ in range(3)]
    alarms = first_alarms(runs, target_acc=0.9, target_cov=0.9)
    assert (alarms["acc_before_shift"] == -1).all()
    # every label after the shift is wrong: the upper bound falls below 0.9 within a few dozen labels
    assert ((alarms["acc_answered"] > 0) & (alarms["acc_answered"] < 60)).all(), alarms["acc_answered"]
    assert (alarms["acc_labels"] == alarms["acc_answered"]).all()  # everything was answered


def test_summary():
    row = summary(np.array([10, 400, -1, 20]), within=300)
    assert row == {"fired": 0.75, "median": 20.0, "p90": 324.0, "max": 400, "within_300": 0.5}


def test_after_a_long_history_the_change_detector_fires_where_the_sequence_cannot():
    """A version that read 3,000 right answers: its confidence sequence's upper bound needs hundreds of wrong ones to
    fall below 0.9, the change detector a few dozen, whatever the history's length."""
    rng = np.random.default_rng(3)
    base, broken = stream(300, True, 0.05), stream(400, False, 0.9)
    past = history(rng, base, 3000, seeds=3, target_acc=0.9, target_cov=0.9)
    assert not past["alarmed"].any()
    runs = [replay_seed(rng, base, broken, 10, 400, delay=0, quantile=0.3, rate=0.01, target_cov=0.9)
            for _ in range(3)]
    alarms = first_alarms(runs, target_acc=0.9, target_cov=0.9, start=past)
    assert ((alarms["acc_answered"] > 0) & (alarms["acc_answered"] < 40)).all(), alarms["acc_answered"]
    assert alarms["acc_by_detector"].all()  # the sequence had not crossed yet
    fresh = first_alarms(runs, target_acc=0.9, target_cov=0.9)  # a new version: the sequence fires as fast
    assert ((fresh["acc_answered"] > 0) & (fresh["acc_answered"] < 60)).all()


def test_bad_inputs_are_one_line_before_any_work(tmp_path, capsys):
    from benchmarks.feedback_replay import main

    assert main(["--artifact", str(tmp_path / "nope"), "--output", str(tmp_path / "r.json")]) == 2
    assert "nope/manifest.json not found" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["--output", str(tmp_path / "afile" / "r.json")]) == 2  # found before the replays, not after
    assert "--output" in capsys.readouterr().err
    assert main(["--name", "nope", "--output", str(tmp_path / "r.json")]) == 2
    assert "no stored outputs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--draws", "0"])
    assert "--draws: must be >= 1, got 0" in capsys.readouterr().err
