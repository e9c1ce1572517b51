import json

import pytest

from benchmarks.device_floor import compare, main


def record(key, kind, method, steps, accuracy, ece, nll, n=300, budget=760):
    return {"key": key, "kind": kind, "method": method, "seed": 0, "metrics": {"n": n, "accuracy": accuracy,
            "ece": ece, "nll": nll}, "training": {"best_steps": steps, "budget_steps": budget}}


def grids():
    a = [record("id-map-s0", "id", "map", [38], 0.80, 0.050, 0.40),
         record("ood-map-s0", "ood", "map", [38], 0.10, 0.90, 9.0),  # shares id's run: not a pair
         record("id-ib_edl-s0", "id", "ib_edl", [152], 0.70, 0.100, 0.60),
         record("noise-edl-s0", "noise", "edl", [0], 0.75, 0.020, 0.50),
         record("id-vid-s0", "id", "vid", [76], 0.90, 0.010, 0.30),
         record("id-r_edl-s0", "id", "r_edl", [76], 0.90, 0.010, 0.30)]
    b = [record("id-map-s0", "id", "map", [38], 0.80, 0.052, 0.401),
         record("ood-map-s0", "ood", "map", [38], 0.50, 0.10, 1.0),
         record("id-ib_edl-s0", "id", "ib_edl", [152], 0.71, 0.082, 0.59),
         record("noise-edl-s0", "noise", "edl", [0], 0.75, 0.020001, 0.50),
         record("id-vid-s0", "id", "vid", [342], 0.95, 0.050, 0.20),
         record("id-i_edl-s0", "id", "i_edl", [76], 0.90, 0.010, 0.30)]
    return a, b


def test_pairs_cells_that_kept_the_same_step_and_splits_evaluation_from_training():
    result = compare(*grids())
    assert result["only_in_a"] == ["id-r_edl-s0"] and result["only_in_b"] == ["id-i_edl-s0"]
    assert result["other_steps"] == [{"key": "id-vid-s0", "steps_a": [76], "steps_b": [342], "budget_a": 760,
                                      "budget_b": 760}]
    assert [p["key"] for p in result["pairs"]] == ["id-ib_edl-s0", "id-map-s0", "id-vid-s0", "noise-edl-s0"]
    start = result["evaluation_only"]
    assert start["pairs"] == 1 and start["ece"]["max_abs"] == pytest.approx(1e-4)  # points
    trained = result["training_and_evaluation"]
    assert trained["pairs"] == 2
    assert trained["accuracy"]["max_abs"] == pytest.approx(1.0) and trained["accuracy"]["max_at"] == "id-ib_edl-s0"
    assert trained["ece"]["max_abs"] == pytest.approx(1.8) and trained["ece"]["mean_abs"] == pytest.approx(1.0)
    assert trained["nll"]["mean_abs"] == pytest.approx((0.001 + 0.01) / 2)
    ib = next(p for p in result["pairs"] if p["key"] == "id-ib_edl-s0")
    assert ib["accuracy"] == pytest.approx(1.0) and ib["ece"] == pytest.approx(-1.8)  # b minus a
    assert result["by_method"]["map"]["pairs"] == 1 and set(result["by_method"]) == {"ib_edl", "map"}
    assert start["accuracy"] == {"max_abs": 0.0, "mean_abs": 0.0, "max_at": None}  # no cell to name


def test_another_budget_or_unrecorded_steps_are_not_comparable():
    a, b = grids()
    b[0]["training"]["budget_steps"] = 1250  # another schedule: the same kept step is another state
    a[2]["training"]["best_steps"] = b[2]["training"]["best_steps"] = [None]  # a run that recorded no kept step
    result = compare(a, b)
    assert {o["key"] for o in result["other_steps"]} == {"id-map-s0", "id-ib_edl-s0", "id-vid-s0"}
    assert result["training_and_evaluation"] == {"pairs": 0}


def test_refuses_cells_with_other_test_sets():
    a, b = grids()
    b[0]["metrics"]["n"] = 1000
    with pytest.raises(ValueError, match="id-map-s0: 300 test questions in a, 1000 in b"):
        compare(a, b)


def floor(a, b, out) -> int:
    return main(["--a", str(a), "--a-device", "cpu", "--b", str(b), "--b-device", "h100", "--output", str(out)])


def test_cli_writes_the_result_and_refuses_files_that_are_not_the_same_grid(tmp_path, capsys):
    a, b = grids()
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "floor.json"
    assert floor(tmp_path / "a.json", tmp_path / "b.json", out) == 0
    written = json.loads(out.read_text())
    assert written["a"]["device"] == "cpu" and written["training_and_evaluation"]["pairs"] == 2
    assert "training_and_evaluation: 2 pairs" in capsys.readouterr().out

    (tmp_path / "other.json").write_text(json.dumps([record("id-x-s9", "id", "x", [1], 0.5, 0.1, 1.0)]))
    assert floor(tmp_path / "a.json", tmp_path / "other.json", out) == 2
    assert "share no trained cell" in capsys.readouterr().err
    (tmp_path / "dict.json").write_text("{}")
    assert floor(tmp_path / "dict.json", tmp_path / "b.json", out) == 2
    assert "holds a list of records, got dict" in capsys.readouterr().err
    assert floor(tmp_path / "missing.json", tmp_path / "b.json", out) == 2
    assert "missing.json" in capsys.readouterr().err
    (tmp_path / "numbers.json").write_text("[1, 2]")
    assert floor(tmp_path / "a.json", tmp_path / "numbers.json", out) == 2
    assert f"{tmp_path / 'numbers.json'}: record 0 is not a grid cell" in capsys.readouterr().err
    (tmp_path / "blocked").write_text("a file where a folder should be")
    assert floor(tmp_path / "a.json", tmp_path / "b.json", tmp_path / "blocked" / "floor.json") == 2
    assert "cannot write" in capsys.readouterr().err
