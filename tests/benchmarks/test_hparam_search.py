import json

import pytest

from benchmarks.hparam_search import candidates, choose, main, markdown_table


def record(method, index, start, end, **overrides):
    metrics = lambda nll: {"accuracy": 0.8, "mean_confidence": 0.9, "ece": 0.05, "nll": nll, "brier": 0.2}  # noqa: E731
    return {"method": method, "index": index, "overrides": overrides, "validation_start": metrics(start),
            "validation_end": metrics(end), "steps": 76, "best_step": 38, "stopped_by": "patience"}


def test_choice_is_the_lowest_validation_nll_first_listed_on_a_tie():
    records = [record("map", 0, 0.4, 0.35), record("map", 1, 0.4, 0.30), record("edl", 0, 0.5, 0.45),
               record("edl", 1, 0.5, 0.45)]
    chosen = choose(records)
    assert chosen["map"]["index"] == 1 and chosen["map"]["validation_nll"] == 0.30
    assert chosen["edl"]["index"] == 0


def test_candidates_are_read_from_the_search_section_and_checked():
    config = {"search": {"candidates": {"map": [{"optim.lr": 1e-4}, {"optim.lr": 1e-3}]}}}
    assert candidates(config) == [("map", 0, {"optim.lr": 1e-4}), ("map", 1, {"optim.lr": 1e-3})]
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        candidates({"search": {"candidates": {"nope": [{}]}}})
    with pytest.raises(ValueError, match=r"search.candidates.map must be a non-empty list of overrides, got \[\]"):
        candidates({"search": {"candidates": {"map": []}}})
    with pytest.raises(ValueError, match="the config has no search.candidates section"):
        candidates({})


def test_table_marks_the_choice_and_the_cli_prints_it(tmp_path, capsys):
    records = [record("map", 0, 0.4, 0.35, **{"optim.lr": 1e-4}), record("map", 1, 0.4, 0.30, **{"optim.lr": 1e-3})]
    results = {"candidates": records, "chosen": choose(records)}
    table = markdown_table(results)
    assert "| map | lr 0.001 | 80 → 80 | 0.900 → 0.900 | 5.0 → 5.0 | **0.4000 → 0.3000** | 76 (38) |" in table
    assert "| map | lr 0.0001 | 80 → 80 | 0.900 → 0.900 | 5.0 → 5.0 | 0.4000 → 0.3500 | 76 (38) |" in table
    (tmp_path / "grid.yaml").write_text("name: grid\nsearch:\n  candidates: {map: [{optim.lr: 1.0e-4}]}\n")
    (tmp_path / "out.json").write_text(json.dumps(results))
    assert main(["--config", str(tmp_path / "grid.yaml"), "--output", str(tmp_path / "out.json"), "--table"]) == 0
    assert capsys.readouterr().out.strip() == table
    assert main(["--config", str(tmp_path / "grid.yaml"), "--output", str(tmp_path / "none.json"), "--table"]) == 2
    capsys.readouterr()
    assert main(["--config", str(tmp_path / "grid.yaml"), "--only-methods", "vid", "a=b", "--table"]) == 2
    err = capsys.readouterr().err  # this CLI takes no overrides: no hint to put them first
    assert "--only-methods: ['a=b', 'vid'] not among its search candidates (['map'])" in err and "overrides" not in err


def test_a_search_resumes_from_its_results_file_without_training(tmp_path, monkeypatch):
    import benchmarks.hparam_search as search

    (tmp_path / "grid.yaml").write_text(
        "name: grid\nsearch:\n  candidates: {map: [{optim.lr: 1.0e-4}, {optim.lr: 1.0e-3}]}\n")
    done = record("map", 0, 0.4, 0.35, **{"optim.lr": 1e-4})
    stale = record("map", 1, 0.4, 0.2, **{"optim.lr": 5e-3})  # the same index with other overrides: trained again
    (tmp_path / "out.json").write_text(json.dumps({"candidates": [done, stale], "chosen": {}}))
    trained = []

    def fake_train(config, root, method, index, overrides, threads):
        trained.append((method, index))
        return record(method, index, 0.4, 0.3, **overrides)

    monkeypatch.setattr(search, "train_candidate", fake_train)
    assert main(["--config", str(tmp_path / "grid.yaml"), "--output", str(tmp_path / "out.json")]) == 0
    assert trained == [("map", 1)]
    result = json.loads((tmp_path / "out.json").read_text())
    assert [r["validation_end"]["nll"] for r in result["candidates"]] == [0.35, 0.3]
    assert result["chosen"]["map"]["index"] == 1


def test_a_candidate_edited_since_its_run_trains_again(tmp_path, tiny_model_dir, monkeypatch):
    """A run of the candidate's very config is reused; one trained under other overrides is not (its metrics were
    filed beside the edited candidate's new overrides)."""
    from benchmarks import hparam_search

    config = {"name": "tiny", "search": {"dataset": "sciq", "candidates": {"map": [{}]}},
              "train": {"base_model": str(tiny_model_dir), "max_tokens": 128, "optim": {"max_steps": 1}},
              "sizes": {"default": {"train": 4, "validation": 4}}}
    trained = []

    def child(cmd, log_path, threads=None):
        from ibedl.training.config import load_config

        trained.append(cmd)
        cfg = load_config(None, cmd[3:])
        head_lr = cfg.optim.head_lr
        run = {"validation_start": {"nll": 1.0}, "validation_end": {"nll": head_lr}, "stopped_step": 1,
               "best_step": 1, "budget_steps": 1, "stopped_by": "budget"}  # what the record reads
        (log_path.parent / "manifest.json").write_text(json.dumps({"training": {"config": cfg.to_dict(), "run": run}}))
        return {"returncode": 0}

    monkeypatch.setattr(hparam_search, "run_child", child)
    for head_lr, runs in ((1e-3, 1), (1e-3, 1), (0.5, 2)):
        record = hparam_search.train_candidate(config, tmp_path, "map", 0, {"optim.head_lr": head_lr}, None)
        assert len(trained) == runs and record["validation_end"]["nll"] == head_lr, head_lr
    assert "optim.head_lr=0.5" in trained[-1]


def test_an_output_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    (tmp_path / "grid.yaml").write_text("name: grid\nsearch:\n  candidates: {map: [{optim.lr: 1.0e-4}]}\n")
    assert main(["--config", str(tmp_path / "grid.yaml"), "--output", str(tmp_path / "afile" / "s.json")]) == 2
    assert "--output" in capsys.readouterr().err
