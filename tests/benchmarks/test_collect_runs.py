"""benchmarks/collect_runs.py: run directories -> one JSON of commands, curves and metrics, read back."""

import json

import pytest

from benchmarks.collect_runs import collect, main
from ibedl.training.confidence_ceiling import confidence_ceiling


def fake_run(tmp_path, name, method="ib_edl", method_config=None, ceiling=None, accuracy=0.8):
    run = tmp_path / name
    run.mkdir()
    manifest = {
        "name": "default", "method": method, "method_config": method_config or {},
        "training": {"command": f"python -m ibedl.training.finetune output={name}",
                     "run": {"seconds": 12.5, "steps": 3}, "confidence_ceiling": ceiling, "zeta": None},
        "metrics": {"test": {"accuracy": accuracy, "ece": 0.05, "nll": 0.4}},
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    history = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9, "validation": {"accuracy": 0.5, "nll": 1.2}},
               {"step": 3, "loss": 0.8}]
    (run / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    return run


def test_entries_are_named_by_directory_and_replaced_not_duplicated(tmp_path):
    out = tmp_path / "runs.json"
    collect(out, [fake_run(tmp_path, "a", method="map"), fake_run(tmp_path, "b", method="map")], note="first")
    again = tmp_path / "again"
    again.mkdir()
    collect(out, [fake_run(again, "a", method="map", accuracy=0.9)])
    data = json.loads(out.read_text())
    assert data["note"] == "first"
    assert [r["name"] for r in data["runs"]] == ["b", "a"]
    a = data["runs"][1]
    assert a["metrics"]["test"]["accuracy"] == 0.9
    assert a["command"] == "python -m ibedl.training.finetune output=a"
    assert a["validation_during_training"] == [{"step": 2, "accuracy": 0.5, "nll": 1.2}]
    assert (a["train_seconds"], a["steps"], a["confidence_ceiling"]) == (12.5, 3, None)


def test_ceiling_is_recomputed_for_manifests_that_predate_it(tmp_path):
    out = tmp_path / "runs.json"
    collect(out, [fake_run(tmp_path, "old", method_config={"beta": 1e-3, "risk": "nll"})])
    ceiling = json.loads(out.read_text())["runs"][0]["confidence_ceiling"]
    assert ceiling["confidence"] == pytest.approx(confidence_ceiling(1e-3, 4, "nll").confidence)
    assert ceiling["risk"] == "nll"


def test_cli_reports_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "out.json"), str(tmp_path / "empty")]) == 2
    assert "manifest.json not found" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_cli_reports_a_broken_history_line(tmp_path, capsys):
    run = fake_run(tmp_path, "r")
    (run / "history.jsonl").write_text('{"step": 1}\n{oops\n')
    assert main([str(tmp_path / "out.json"), str(run)]) == 2
    assert "history.jsonl:2: not JSON" in capsys.readouterr().err


def test_training_windows_count_collapsed_steps():
    from benchmarks.collect_runs import training_windows

    records = [{"step": s, "batch_accuracy": 0.25 if s <= 50 else 1.0, "grad_norm": 2.0,
                "uncertainty": 0.99 if s % 5 == 0 else 0.5} for s in range(1, 71)]
    records.append({"step": 70, "validation": {"accuracy": 0.9}})  # not a training step
    first, second = training_windows(records)
    assert first == {"steps": [1, 50], "logged": 50, "batch_accuracy": 0.25, "grad_norm": 2.0,
                     "collapsed_fraction": 10 / 50}
    assert second["steps"] == [51, 100] and second["logged"] == 20
    assert second["batch_accuracy"] == 1.0 and second["collapsed_fraction"] == 4 / 20
    softmax = training_windows([{"step": 1, "batch_accuracy": 0.5, "grad_norm": 1.0}])
    assert "collapsed_fraction" not in softmax[0]  # no uncertainty mass logged: nothing to count
