import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.grid_predictions import GridPredictions, collect, compact, load, main, merged, padded, unpadded
from ibedl.training import metrics

REPO = Path(__file__).resolve().parents[2]


def cached(seed: int, n: int = 50, zeta: bool = True) -> dict:
    """A predictions file as the benchmark runner caches it: mixed option counts, u, sigma, the zeta-free row."""
    rng = np.random.default_rng(seed)
    probs = [rng.dirichlet(np.ones(c)).tolist() for c in rng.integers(2, 6, size=n)]
    labels = [int(rng.integers(0, len(p))) for p in probs]
    out = {"probs": probs, "labels": labels, "uncertainty": rng.uniform(0, 1, n).tolist(),
           "sigma": rng.uniform(0, 2, n).tolist(), "samples_per_s": 3.0, "energy": [0.0] * n}
    if zeta:
        out["without_posthoc"] = {"probs": [rng.dirichlet(np.ones(len(p))).tolist() for p in probs],
                                  "uncertainty": rng.uniform(0, 1, n).tolist(), "sigma": None}
    return out


def test_padding_round_trips_rows_of_every_length():
    rows = [[0.5, 0.5], [0.2, 0.3, 0.5], [0.1, 0.2, 0.3, 0.2, 0.2]]
    arr = padded(rows)
    assert arr.shape == (3, 5) and arr.dtype == np.float32 and np.isnan(arr[0, 2:]).all()
    back = unpadded(arr)
    assert [len(r) for r in back] == [2, 3, 5]
    for got, want in zip(back, rows, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-7)
    with pytest.raises(ValueError, match="empty"):
        padded([])


def test_compact_refuses_mismatched_rows_and_labels():
    bad = cached(0)
    bad["labels"] = bad["labels"][:-1]
    with pytest.raises(ValueError, match="49 labels"):
        compact(bad)
    with pytest.raises(ValueError, match="'labels'"):
        compact({"probs": [[1.0]]})


def test_the_kept_file_gives_every_metric_the_json_gives(tmp_path):
    runs = tmp_path / "runs"
    (runs / "sciq-ib_edl-s0").mkdir(parents=True)
    (runs / "sciq-map-s0").mkdir(parents=True)
    files = {("sciq-ib_edl-s0", "ib_edl", "sciq"): cached(1),
             ("sciq-ib_edl-s0", "ib_edl", "sciq:no_context"): cached(2),
             ("sciq-map-s0", "map_ts", "sciq"): cached(3, zeta=False)}
    for (train, method, dataset), body in files.items():
        (runs / train / f"predictions-{method}-{dataset.replace(':', '-')}.json").write_text(json.dumps(body))
    (runs / "sciq-map-s0" / "predictions-map.partial.json").write_text("{}")  # an interrupted evaluation: skipped
    out = tmp_path / "grid.predictions.npz"
    np.savez_compressed(out, **collect(runs, ["sciq", "sciq:no_context"]))
    kept = load(out)
    for (train, method, dataset), body in files.items():
        got = kept.get(train, method, dataset)
        assert got["labels"].tolist() == body["labels"]
        for name in ("accuracy", "ece", "nll", "brier"):
            fn = getattr(metrics, name)
            assert fn(got["probs"], got["labels"]) == pytest.approx(fn(body["probs"], body["labels"]), abs=1e-6)
        np.testing.assert_allclose(got["uncertainty"], body["uncertainty"], rtol=1e-6)
        if "without_posthoc" in body:
            bare = kept.get(train, method, dataset, bare=True)
            assert metrics.nll(bare["probs"], bare["labels"]) == pytest.approx(
                metrics.nll(body["without_posthoc"]["probs"], body["labels"]), abs=1e-6)
    with pytest.raises(KeyError, match="no predictions without a post-hoc step"):
        kept.get("sciq-map-s0", "map_ts", "sciq", bare=True)
    with pytest.raises(KeyError, match="no kept predictions"):
        kept.get("sciq-map-s1", "map", "sciq")


def test_a_set_the_grid_does_not_have_is_refused(tmp_path):
    (tmp_path / "sciq-map-s0").mkdir()
    (tmp_path / "sciq-map-s0" / "predictions-map-obqa.json").write_text(json.dumps(cached(0, zeta=False)))
    with pytest.raises(ValueError, match="'obqa' is none of the grid's"):
        collect(tmp_path, ["sciq"])
    with pytest.raises(ValueError, match="no cached predictions"):
        collect(tmp_path / "sciq-map-s0", ["sciq"])


def test_main_says_what_is_missing_without_a_trace(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--grid", "no_such_grid"]) == 2
    assert "error:" in capsys.readouterr().err


def test_runs_trained_elsewhere_stay_in_the_kept_file_and_runs_here_replace_theirs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the grid's config: benchmarks/sciq_grid_shared_lr.yaml
    out = tmp_path / "grid.predictions.npz"
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for runs, train, seed in ((elsewhere, "sciq-map-s0", 1), (elsewhere, "sciq-edl-s1", 2), (here, "sciq-edl-s1", 3),
                              (here, "sciq-map-s4", 4)):
        (runs / train).mkdir(parents=True, exist_ok=True)
        (runs / train / f"predictions-{train.split('-')[1]}-sciq.json").write_text(json.dumps(cached(seed)))
    args = ["--grid", "sciq_grid_shared_lr", "--output", str(out)]
    assert main([*args, "--runs-dir", str(elsewhere)]) == 0
    assert main([*args, "--runs-dir", str(here)]) == 0  # another checkout: seed 0's runs are not here
    assert "1 (run, method, set)s kept from the file" in capsys.readouterr().out
    kept = load(out)
    assert kept.seeds() == {0, 1, 4}
    for train, method, seed in (("sciq-map-s0", "map", 1), ("sciq-edl-s1", "edl", 3), ("sciq-map-s4", "map", 4)):
        body = cached(seed)
        assert kept.get(train, method, "sciq")["labels"].tolist() == body["labels"]
        np.testing.assert_allclose(kept.get(train, method, "sciq")["uncertainty"], body["uncertainty"], rtol=1e-6)
        np.testing.assert_allclose(kept.get(train, method, "sciq", bare=True)["uncertainty"],
                                   body["without_posthoc"]["uncertainty"], rtol=1e-6)
    assert main([*args, "--runs-dir", str(here), "--replace"]) == 0
    assert load(out).seeds() == {1, 4}
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["grid.predictions.npz"]  # nothing partial
    out.write_bytes(out.read_bytes()[:100])  # an earlier write cut short (the file was written in place)
    assert main([*args, "--runs-dir", str(here)]) == 2
    err = capsys.readouterr().err
    assert "is not a whole .npz" in err and "or pass --replace" in err
    assert main([*args[:-1], str(tmp_path / "x.preds"), "--runs-dir", str(here)]) == 2
    assert "must end in .npz" in capsys.readouterr().err and not (tmp_path / "x.preds.npz").exists()


def test_merging_warns_of_a_run_from_two_collections_and_refuses_sets_the_grid_dropped(caplog):
    kept = GridPredictions({**{f"sciq-edl-s1|edl|sciq|{k}": v for k, v in compact(cached(1)).items()},
                            **{f"sciq-edl-s1|edl|obqa|{k}": v for k, v in compact(cached(2)).items()}})
    fresh = {f"sciq-edl-s1|edl|sciq|{k}": v for k, v in compact(cached(3)).items()}
    arrays, left = merged(kept, fresh, ["sciq", "obqa"])
    assert left == ["sciq-edl-s1 edl obqa"] and "runs with rows both kept and collected here" in caplog.text
    np.testing.assert_array_equal(arrays["sciq-edl-s1|edl|sciq|labels"], fresh["sciq-edl-s1|edl|sciq|labels"])
    with pytest.raises(ValueError, match=r"sets the grid no longer evaluates \(sciq-edl-s1 edl obqa\)"):
        merged(kept, fresh, ["sciq"])
