import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.paired_bootstrap import PerQuestion, paired_bootstrap
from ibedl.training import metrics


def calibrated_sample(n: int, options: int = 4, seed: int = 0):
    """Probabilities from a Dirichlet and labels drawn from them: calibrated by construction."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(options, 0.5), size=n)
    labels = np.array([rng.choice(options, p=p) for p in probs])
    return probs, labels


def sharpen(probs: np.ndarray, temperature: float) -> np.ndarray:
    z = np.log(probs) / temperature
    z = np.exp(z - z.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def test_full_set_metrics_match_training_metrics_with_mixed_option_counts():
    rng = np.random.default_rng(3)
    probs = [rng.dirichlet(np.ones(c)) for c in rng.integers(2, 6, size=300)]
    labels = [int(rng.integers(0, len(p))) for p in probs]
    got = PerQuestion.from_probs(probs, labels).metrics(np.arange(300)[None, :])
    assert got["accuracy"][0] == pytest.approx(metrics.accuracy(probs, labels))
    assert got["ece"][0] == pytest.approx(metrics.ece(probs, labels, 15), abs=1e-12)
    assert got["nll"][0] == pytest.approx(metrics.nll(probs, labels))
    assert got["brier"][0] == pytest.approx(metrics.brier(probs, labels))


def test_resampled_ece_equals_training_metrics_on_the_resampled_questions():
    probs, labels = calibrated_sample(200, seed=1)
    index = np.random.default_rng(0).integers(0, 200, size=(3, 200))
    got = PerQuestion.from_probs(probs, labels).metrics(index)["ece"]
    for r in range(3):
        assert got[r] == pytest.approx(metrics.ece(probs[index[r]], labels[index[r]], 15), abs=1e-12)


def test_an_adapter_compared_with_itself_differs_by_exactly_zero():
    probs, labels = calibrated_sample(100)
    a = PerQuestion.from_probs(probs, labels)
    out = paired_bootstrap(a, a, resamples=200)
    for m in ("accuracy", "ece", "nll", "brier"):
        assert out[m]["difference"] == 0 and out[m]["ci95"] == [0.0, 0.0] and out[m]["share_better"] == 0


def test_bootstrap_spread_of_the_accuracy_difference_matches_its_closed_form():
    """The paired difference of accuracies is the mean of d_i = hit_b - hit_a: its std is std(d) / sqrt(n)."""
    rng = np.random.default_rng(5)
    n = 1000
    labels = rng.integers(0, 4, size=n)
    def onehot_guess(p_right):
        guess = np.where(rng.random(n) < p_right, labels, (labels + 1) % 4)
        return np.eye(4)[guess] * 0.7 + 0.075
    a, b = PerQuestion.from_probs(onehot_guess(0.8), labels), PerQuestion.from_probs(onehot_guess(0.85), labels)
    out = paired_bootstrap(a, b, resamples=4000, seed=1)
    d = b.hit - a.hit
    sd = d.std() / np.sqrt(n)
    lo, hi = out["accuracy"]["ci95"]
    assert out["accuracy"]["difference"] == pytest.approx(d.mean())
    assert (hi - lo) / (2 * 1.96) == pytest.approx(sd, rel=0.1)


def test_an_over_confident_copy_of_a_calibrated_adapter_is_worse_beyond_noise():
    probs, labels = calibrated_sample(1000, seed=2)
    calibrated = PerQuestion.from_probs(probs, labels)
    over = PerQuestion.from_probs(sharpen(probs, 0.4), labels)  # same answers, sharper
    out = paired_bootstrap(calibrated, over, resamples=1000)
    assert out["accuracy"]["difference"] == 0
    for m in ("ece", "nll", "brier"):
        assert out[m]["ci95"][0] > 0, (m, out[m])  # the over-confident copy is worse on every resample range
        assert out[m]["share_better"] < 0.01


def test_bad_inputs_name_the_problem():
    probs, labels = calibrated_sample(10)
    with pytest.raises(ValueError, match="label 7 of question 0"):
        PerQuestion.from_probs(probs, [7] + list(labels[1:]))
    with pytest.raises(ValueError, match="10 rows and 9 labels"):
        PerQuestion.from_probs(probs, labels[:9])
    a = PerQuestion.from_probs(probs, labels)
    b = PerQuestion.from_probs(probs[:5], labels[:5])
    with pytest.raises(ValueError, match="10 and 5"):
        paired_bootstrap(a, b)
    with pytest.raises(ValueError, match="at least 100, got 10"):
        paired_bootstrap(a, a, resamples=10)


def test_compares_adapters_on_a_users_own_jsonl_questions(tiny_artifact, tiny_jsonl, tmp_path, capsys):
    """``--dataset jsonl --path FILE``: the comparison runs on the user's own test questions; an adapter against
    itself differs by exactly zero; a missing file is a usage error naming it."""
    from benchmarks.paired_bootstrap import main

    out = tmp_path / "cmp.json"
    assert main(["--reference", str(tiny_artifact), "--artifacts", str(tiny_artifact), "--dataset", "jsonl",
                 "--path", str(tiny_jsonl), "--resamples", "100", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    n = len(tiny_jsonl.read_text().splitlines())
    assert result["path"] == str(tiny_jsonl) and result["n"] == n and result["dataset"] == "jsonl"
    (diff,) = result["comparisons"].values()
    assert diff["accuracy"]["difference"] == 0.0 and diff["ece"]["ci95"] == [0.0, 0.0]
    with pytest.raises(SystemExit) as exit_:
        main(["--reference", str(tiny_artifact), "--artifacts", str(tiny_artifact), "--dataset", "jsonl",
              "--path", str(tmp_path / "nope.jsonl"), "--output", str(out)])
    assert exit_.value.code == 2 and "nope.jsonl" in capsys.readouterr().err


def test_unseen_by_leaves_out_what_every_artifact_and_its_starts_drew(tmp_path, monkeypatch):
    """drawn_by follows each artifact's init_from to the first run without one, once per artifact."""
    from benchmarks import paired_bootstrap
    from ibedl.training import finetune

    drew = {"stage1": {"a", "b"}, "stage2": {"b", "c"}, "twin": {"d"}}
    starts = {"stage1": None, "stage2": "stage1", "twin": "stage1"}
    for name, start in starts.items():
        (tmp_path / name).mkdir()
        config = {"init_from": str(tmp_path / start)} if start else {}
        (tmp_path / name / "manifest.json").write_text(json.dumps({"training": {"config": config}}))
    calls = []

    def fake(path):
        calls.append(Path(path).name)
        return frozenset(drew[Path(path).name])

    monkeypatch.setattr(finetune, "start_training_ids", fake)
    assert paired_bootstrap.drawn_by([tmp_path / "stage2", tmp_path / "twin"]) == {"a", "b", "c", "d"}
    assert sorted(calls) == ["stage1", "stage2", "twin"]  # the shared start read once
    assert paired_bootstrap.drawn_by([]) == frozenset()
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "manifest.json").write_text(json.dumps({"training": {"config": {
        "init_from": str(tmp_path / "gone")}}}))
    drew["orphan"] = set()
    with pytest.raises(ValueError, match="gone: its training questions are unknown"):
        paired_bootstrap.drawn_by([tmp_path / "orphan"])
